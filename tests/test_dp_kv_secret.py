"""The data-parallel app's KV secret: one generated per app build and handed to every engine replica (unless
the operator set PAGEDSERVE_KV_SECRET[_FILE]), so that the offload tier's reads between replicas work out of
the box and stay authenticated (fast for the app; two engine hosts on a tiny model for the reads)."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import SecretStr

from pagedserve.cluster.serve.app import build_app
from pagedserve.cluster.serve.engine_host import EngineHost
from pagedserve.kv_transfer.auth import SECRET_ENV, SECRET_FILE_ENV
from pagedserve.kv_transfer.offload.remote import TierReadAuthError, sign_tier_read


def engine_secret(app) -> SecretStr | None:
    """The kv_secret the app binds its engine deployment with (every replica is built with these args)."""
    ingress = app._bound_deployment
    engine = next(arg for arg in ingress.init_args if hasattr(arg, "_bound_deployment"))._bound_deployment
    assert engine.func_or_class is EngineHost or getattr(engine.func_or_class, "__name__", "") == "EngineHost"
    return engine.init_kwargs.get("kv_secret")


@pytest.fixture
def no_operator_secret(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)


def test_the_app_hands_every_replica_one_fresh_secret(tiny_llama, no_operator_secret):
    args = {"model": str(tiny_llama), "data_parallel_size": 2, "kv_offload_size": "8MiB"}
    first, second = engine_secret(build_app(args)), engine_secret(build_app(args))
    assert isinstance(first, SecretStr) and len(first.get_secret_value()) >= 32
    assert first.get_secret_value() != second.get_secret_value()  # one per app build
    assert first.get_secret_value() not in repr(first)


@pytest.mark.parametrize("env", [SECRET_ENV, SECRET_FILE_ENV])
def test_an_operator_secret_wins(tiny_llama, no_operator_secret, monkeypatch, tmp_path, env):
    if env == SECRET_FILE_ENV:
        (tmp_path / "secret").write_text("o" * 32)
        monkeypatch.setenv(env, str(tmp_path / "secret"))
    else:
        monkeypatch.setenv(env, "o" * 32)
    assert engine_secret(build_app({"model": str(tiny_llama), "kv_offload_size": "8MiB"})) is None


def test_replicas_given_the_app_secret_read_each_others_tier_and_others_are_refused(tiny_llama, no_operator_secret):
    kwargs = {"model": str(tiny_llama), "dtype": "float32", "num_kv_blocks": 16, "block_size": 4,
              "kv_offload_size": "4MiB"}
    app_secret, other_app = SecretStr("a" * 64), SecretStr("b" * 64)
    hosts = [EngineHost(dict(kwargs), kv_secret=app_secret), EngineHost(dict(kwargs), kv_secret=app_secret),
             EngineHost(dict(kwargs), kv_secret=other_app)]
    try:
        a, b, stranger = hosts
        assert a._kv_secret() == b._kv_secret() == b"a" * 64  # the app's, not this process's own
        hashes = [bytes([7]) * 32]
        namespace = a.engine.kv_offload_tier().location.namespace.name
        # A's kv_tier_read (what a peer replica calls) takes B's signed read (A's tier lacks the block: nothing) ...
        assert asyncio.run(a.kv_tier_read(namespace, hashes, sign_tier_read(b._kv_secret(), namespace, a.replica,
                                                                            hashes), replica=a.replica)) == {}
        # ... and refuses another app's replica's.
        with pytest.raises(TierReadAuthError):
            asyncio.run(a.kv_tier_read(namespace, hashes, sign_tier_read(stranger._kv_secret(), namespace, a.replica,
                                                                         hashes), replica=a.replica))
        assert a._tier_verifier.refused == 1
    finally:
        for host in hosts:
            host.shutdown()

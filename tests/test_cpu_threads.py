"""torch threads of a worker: `cpu_threads` (EngineConfig, LLM, --cpu-threads) sets them; inside a Ray
actor the default is the CPUs the actor reserved when they were chosen (`num_cpus_per_engine`), else the
node's CPUs shared by the engines that may run there (`ray_utils.engine_threads`), even where the actor
inherited OMP_NUM_THREADS=1 (Ray then leaves that variable, and so torch's thread count, alone)."""

from __future__ import annotations

import argparse
import os

import pytest
import torch
from pydantic import ValidationError

from pagedserve.cluster.executor import ray_utils
from pagedserve.cluster.executor.ray_utils import engine_threads
from pagedserve.engine import LLM
from pagedserve.engine.config import EngineConfig


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_cpu_threads_is_validated_by_name(tiny_llama):
    with pytest.raises(ValidationError, match="cpu_threads"):
        EngineConfig(model=str(tiny_llama), cpu_threads=0)
    assert EngineConfig(model=str(tiny_llama)).cpu_threads is None


def test_llm_worker_sets_its_threads(tiny_llama, restore_threads):
    torch.set_num_threads(2)
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", cpu_threads=1)
    try:
        assert torch.get_num_threads() == 1
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)[0]
        assert out.outputs[0].token_ids
    finally:
        llm.shutdown()


def test_cpu_threads_flags(tiny_llama):
    from pagedserve.bench import common
    from pagedserve.cluster.cli import build_parser, serve_args_from

    for command in (["serve"], ["generate", "--prompt", "x"]):
        ns = build_parser().parse_args([*command, str(tiny_llama), "--cpu-threads", "3"])
        assert serve_args_from(ns).engine_kwargs()["cpu_threads"] == 3
    parser = argparse.ArgumentParser()
    common.add_engine_args(parser)
    assert common.engine_kwargs(parser.parse_args(["--cpu-threads", "2"]))["cpu_threads"] == 2
    assert "cpu_threads" not in common.engine_kwargs(parser.parse_args([]))


def test_engine_thread_rule():
    # cpu_threads wins over everything.
    assert engine_threads(3, reserved_cpus=1.0, node_cpus=16, engines_per_node=1) == 3
    assert engine_threads(3, reserved_cpus=8.0, node_cpus=16, engines_per_node=None) == 3
    # The operator chose the reservation: its CPUs, at least 1; none reserved leaves torch's own count.
    assert engine_threads(None, reserved_cpus=4.0, node_cpus=16, engines_per_node=None) == 4
    assert engine_threads(None, reserved_cpus=0.5, node_cpus=16, engines_per_node=None) == 1
    assert engine_threads(None, reserved_cpus=0.0, node_cpus=16, engines_per_node=None) is None
    # The reservation left at its 1-CPU default: the node's CPUs, shared by the app's engines.
    assert engine_threads(None, reserved_cpus=1.0, node_cpus=2, engines_per_node=1) == 2
    assert engine_threads(None, reserved_cpus=1.0, node_cpus=16, engines_per_node=3) == 5
    assert engine_threads(None, reserved_cpus=1.0, node_cpus=2, engines_per_node=4) == 1


def test_node_cpus_is_the_affinity_capped_by_rays_node(monkeypatch):
    monkeypatch.setattr(ray_utils.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(ray_utils.ray, "is_initialized", lambda: False)
    assert ray_utils.node_cpus() == 4
    monkeypatch.setattr(ray_utils.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray_utils.ray, "get_runtime_context",
                        lambda: argparse.Namespace(get_node_id=lambda: "me"))
    nodes = [{"NodeID": "other", "Resources": {"CPU": 1.0}}, {"NodeID": "me", "Resources": {"CPU": 2.0}}]
    monkeypatch.setattr(ray_utils.ray, "nodes", lambda: nodes)
    assert ray_utils.node_cpus() == 2  # `ray start --num-cpus 2` on a 4-core machine
    nodes[1]["Resources"]["CPU"] = 64.0
    assert ray_utils.node_cpus() == 4  # Ray told of more CPUs than this process may run on


def _engine_share(app) -> int | None:
    """The engines_per_node the app binds its engine deployment(s) with (None: the reserved CPUs rule)."""
    ingress = app._bound_deployment
    engines = [arg for arg in ingress.init_args if hasattr(arg, "_bound_deployment")]  # monolithic
    engines += [pool for arg in ingress.init_args if isinstance(arg, dict)  # PD: {role: deployment}
                for pool in arg.values() if hasattr(pool, "_bound_deployment")]
    shares = [engine._bound_deployment.init_kwargs["engines_per_node"] for engine in engines]
    assert shares and len(set(shares)) == 1, shares
    return shares[0]


def test_serve_app_shares_the_node_unless_the_operator_reserved_cpus(tiny_llama):
    from pagedserve.cluster.serve.app import build_app

    model = str(tiny_llama)
    assert _engine_share(build_app({"model": model})) == 1  # one engine: every core of its node
    assert _engine_share(build_app({"model": model, "data_parallel_size": 2})) == 2
    assert _engine_share(build_app({"model": model, "min_replicas": 1, "max_replicas": 3})) == 3
    assert _engine_share(build_app({"model": model, "num_prefill_engines": 1, "num_decode_engines": 2})) == 3
    assert _engine_share(build_app({"model": model, "num_cpus_per_engine": 1})) is None  # explicit, even at 1
    assert _engine_share(build_app({"model": model, "tensor_parallel_size": 2})) is None  # ranks have their own


def test_engine_actor_uses_the_cpus_it_reserved(tiny_llama, monkeypatch):
    ray = pytest.importorskip("ray")
    from pagedserve.cluster.serve.engine_actor import start_engine_actors, wait_engines_ready
    from tests.local_ray import fresh_local_ray

    # Inherited by the raylet and its workers: Ray keeps it, so without our default the actor runs 1 thread.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    kwargs = dict(model=str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", block_size=4)
    with fresh_local_ray(num_cpus=4):
        reserved = start_engine_actors(kwargs, data_parallel_size=1, num_cpus_per_engine=2, name_prefix="threads-a")
        explicit = start_engine_actors({**kwargs, "cpu_threads": 1}, data_parallel_size=1, num_cpus_per_engine=1,
                                       name_prefix="threads-b")
        default = start_engine_actors(kwargs, data_parallel_size=1, name_prefix="threads-c")  # reserves 1 CPU
        try:
            (reserved_info,) = wait_engines_ready(reserved, timeout_s=300)
            (explicit_info,) = wait_engines_ready(explicit, timeout_s=300)
            (default_info,) = wait_engines_ready(default, timeout_s=300)
            assert reserved_info["torch_threads"] == 2
            assert explicit_info["torch_threads"] == 1
            # The node's CPUs: what this machine lets the process run on, at most the 4 Ray was told of.
            assert default_info["torch_threads"] == min(len(os.sched_getaffinity(0)), 4)
            assert ray.available_resources().get("CPU", 0) == pytest.approx(0.0)  # 2 + 1 + 1 reserved
            engine = reserved[0]
            assert ray.get(engine.ready.remote())["torch_threads"] == 2  # asked again, from another call
        finally:
            for handle in reserved + explicit + default:
                ray.kill(handle, no_restart=True)

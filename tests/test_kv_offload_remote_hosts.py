"""The offload tier across nodes through the engine hosts and the request router, in one process (no Ray):
two engine hosts whose tiers live in two directories stand for engines on two nodes, the Serve request
router (fake replicas) routes with its KV index, and the peer call (`kv_tier_read` on the other host, over
Serve in a cluster) is a direct call. A prefix engine A spilled is fetched by engine B when the router
sends the request to B and names A's tier (`kv_tier_peer`): greedy output equal to an engine without a
tier, counted as a remote tier hit in the engine's /metrics figures, every block of both tiers accounted
for; a peer with another secret, a slow peer, a peer that is gone and a malformed hint cost a bounded wait
and a recompute, and the host's stats count each failure by its reason."""

from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace

import pytest

from pagedserve.cluster.serve.engine_host import EngineHost
from pagedserve.cluster.serve.prefix_chooser import tier_peer
from pagedserve.cluster.serve.tier_peer import (
    FETCH_FAILURE_REASONS, PEER_GONE, REFUSED, TIMEOUT, TierFetcher, TierPeer,
)
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.core.block_pool import prompt_block_hashes
from pagedserve.kv_transfer.offload.remote import TierReadAuthError, sign_tier_read
from tests.offload_checks import check_all_blocks
from tests.test_serve_router import make_router, pending

BS = 4
PREFIX = 32
PARAMS = dict(max_tokens=6, temperature=0, ignore_eos=True)


def _host(model, node_dir, replica: str) -> EngineHost:
    host = EngineHost({"model": str(model), "dtype": "float32", "num_kv_blocks": 24, "block_size": BS,
                       "max_num_batched_tokens": 64, "max_num_seqs": 2, "kv_offload_size": "8MiB",
                       "kv_offload_dir": str(node_dir)})
    host.replica = replica  # (what Serve's replica id would be; the fake router's replicas are r0, r1)
    return host


def _in_process(hosts: dict[str, EngineHost]):
    async def call(peer: TierPeer, namespace: str, hashes: list[bytes], auth) -> dict:
        return await hosts[peer.replica].kv_tier_read(namespace, hashes, auth, replica=peer.replica)
    return call


def _as_llm(host: EngineHost) -> SimpleNamespace:
    """What tests/offload_checks.py reads of an engine."""
    return SimpleNamespace(llm_engine=host.engine.engine)


def _wait_all_free(host: EngineHost, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while True:
        stats = host.engine.get_stats().scheduler
        if stats.num_free_blocks == stats.num_total_blocks:
            return
        assert time.monotonic() < end, f"blocks still in use: {stats}"
        time.sleep(0.05)


async def _generate(host: EngineHost, rid: str, prompt: list[int], **kwargs):
    outputs = [o async for o in host.generate(rid, prompt, PARAMS, final_only=True, **kwargs)]
    for later in outputs[1:]:  # (a final_only stream may send checkpoints before its finish)
        outputs[0].add(later)
    return outputs[0]


@pytest.fixture
def nodes(tiny_llama, tmp_path):
    a, b = _host(tiny_llama, tmp_path / "node-a", "r0"), _host(tiny_llama, tmp_path / "node-b", "r1")
    reference = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=4096, block_size=BS)
    yield a, b, reference
    for host in (a, b):
        host.shutdown()
    reference.shutdown()


def _reference(llm: LLM, prompt: list[int]) -> list[int]:
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**PARAMS), use_tqdm=False)
    return out[0].outputs[0].token_ids


async def _spill_on(host: EngineHost, rng: random.Random) -> list[int]:
    prefix = [rng.randrange(8, 200) for _ in range(PREFIX)]
    await _generate(host, "first", prefix + [rng.randrange(8, 200) for _ in range(5)])
    for i in range(3):  # unrelated prompts evict the prefix from the device: it spills to the tier
        await _generate(host, f"filler{i}", [rng.randrange(8, 200) for _ in range(40)])
    host.engine.engine.engine_core.kv_offload_state()  # (the writer caught up)
    return prefix


def test_the_router_names_the_peer_and_the_engine_loads_the_prefix_from_its_tier(nodes):
    a, b, reference = nodes
    router, replicas = make_router(2)
    rng = random.Random(21)
    b._tier_fetcher = TierFetcher(b.engine.kv_offload_tier(), b._kv_secret(), call=_in_process({"r0": a}))

    async def run():
        prefix = await _spill_on(a, rng)
        for replica, host in zip(replicas, (a, b)):
            replica.routing_stats = await host.record_routing_stats()
        replicas[0].routing_stats["num_waiting"] = 1000  # A is busy: the router sends the request to B
        prompt = prefix + [rng.randrange(8, 200) for _ in range(5)]
        call = pending(prompt)
        ranks = await router.choose_replicas(replicas, call)
        assert ranks[0] == [replicas[1]]
        assert call.kwargs["kv_tier_peer"] == {"app": "a", "deployment": "e", "replica": "r0"}
        out = await _generate(b, "q", prompt, **call.kwargs)
        router.observe_cached("req", out.num_cached_tokens)  # (the prediction counted the peer's run)
        return prompt, out, await b.get_stats()

    prompt, out, stats = asyncio.run(run())
    assert router.prediction_counters.checked == router.prediction_counters.matched == 1
    assert out.outputs[0].token_ids == _reference(reference, prompt)
    assert out.num_cached_tokens == PREFIX
    assert stats.kv_offload_remote_hit_tokens == stats.kv_offload_hit_tokens == PREFIX
    assert b.engine.get_stats().scheduler.kv_offload["remote_fetched_blocks"] == PREFIX // BS and b._tier_fetcher.stats.failures == 0
    for host in (a, b):
        _wait_all_free(host)
    check_all_blocks(_as_llm(a), _as_llm(b))


@pytest.mark.parametrize("fault", ["other_secret", "slow_peer", "peer_gone", "malformed_hint", "peer_is_self"])
def test_a_failed_fetch_costs_a_bounded_wait_and_a_recompute(nodes, fault):
    a, b, reference = nodes
    rng = random.Random(22)
    hint = {"app": "a", "deployment": "e", "replica": "r0"}
    secret, call = b._kv_secret(), _in_process({"r0": a})
    if fault == "other_secret":
        secret = b"another deployment's secret 0123"
    elif fault == "slow_peer":
        async def call(peer, namespace, hashes, auth):  # noqa: F811 - a peer that never answers in time
            await asyncio.sleep(30)
    elif fault == "peer_gone":  # the hint names a replica that went away: the pinned call reaches another
        hint, call = {**hint, "replica": "r2"}, _in_process({"r2": a})
    elif fault == "malformed_hint":
        hint = {"app": "a", "deployment": "e", "replica": 7}
    else:
        hint = {**hint, "replica": "r1"}
    b._tier_fetcher = TierFetcher(b.engine.kv_offload_tier(), secret, timeout_s=0.5, call=call)

    async def run():
        prefix = await _spill_on(a, rng)
        prompt = prefix + [rng.randrange(8, 200) for _ in range(5)]
        started = time.monotonic()
        out = await _generate(b, "q", prompt, kv_tier_peer=hint)
        return prompt, out, time.monotonic() - started, await b.get_stats()

    prompt, out, _, stats = asyncio.run(run())
    assert out.outputs[0].token_ids == _reference(reference, prompt)
    assert out.num_cached_tokens == 0 and stats.kv_offload_remote_hit_tokens == 0
    assert b.engine.get_stats().scheduler.kv_offload["remote_fetched_blocks"] == 0
    reason = {"other_secret": REFUSED, "slow_peer": TIMEOUT, "peer_gone": PEER_GONE}.get(fault)
    assert b._tier_fetcher.stats.failures == int(reason is not None) == b._tier_fetcher.stats.fetches
    # The host's stats (what /metrics sums) count it by reason.
    expected = dict.fromkeys(FETCH_FAILURE_REASONS, 0)
    if reason is not None:
        expected[reason] = 1
    assert stats.kv_tier_fetch_failures == expected
    if fault == "other_secret":
        assert a._tier_verifier.refused == 1
    for host in (a, b):
        _wait_all_free(host)
    check_all_blocks(_as_llm(a), _as_llm(b))


def test_an_unsigned_read_of_a_host_is_refused_and_another_namespace_gets_nothing(nodes):
    a, _, _ = nodes
    rng = random.Random(23)
    prefix = asyncio.run(_spill_on(a, rng))
    hashes = prompt_block_hashes(prefix, BS)
    namespace = a.engine.kv_offload_tier().location.namespace.name
    with pytest.raises(TierReadAuthError):
        asyncio.run(a.kv_tier_read(namespace, hashes, None, replica="r0"))
    other = "pagedserve-kv-" + "0" * 32  # engines of another model or KV layout: never interchangeable
    signed = sign_tier_read(a._kv_secret(), other, "r0", hashes)
    assert asyncio.run(a.kv_tier_read(other, hashes, signed, replica="r0")) == {}
    signed = sign_tier_read(a._kv_secret(), namespace, "r0", hashes)
    assert set(asyncio.run(a.kv_tier_read(namespace, hashes, signed, replica="r0"))) == set(hashes)
    with pytest.raises(ConnectionError):  # a read meant for another replica that reached this one
        asyncio.run(a.kv_tier_read(namespace, [b"\0" * 32], None, replica="r9"))


def test_tier_peer_names_a_fresh_replica_whose_tier_holds_a_longer_run():
    from pagedserve.cluster.serve.kv_index import ClusterKVIndex, ReplicaView

    keys = [bytes([i]) * 8 for i in range(6)]
    index = ClusterKVIndex()
    index.views = {
        "chosen": ReplicaView(tiers={"device": set(keys[:2])}, stale=None),
        "device_only": ReplicaView(tiers={"device": set(keys)}, stale=None),  # a device is no tier to read
        "tier": ReplicaView(tiers={"disk": set(keys[:4])}, stale=None),
        "gap": ReplicaView(tiers={"host": set(keys[1:])}, stale=None),  # the run starts at the first block
        "stale": ReplicaView(tiers={"host": set(keys)}),
    }
    names = list(index.views)
    assert tier_peer(index, "chosen", names, keys) == ("tier", 4)
    assert tier_peer(index, "chosen", names, keys, held_blocks=4) is None  # (the router knows it holds 4)
    assert tier_peer(index, "chosen", ["chosen", "device_only", "gap", "stale"], keys) is None
    assert tier_peer(index, "tier", names, keys) is None  # the choice holds as much as anyone's tier

"""A router's KV index (kv_index.ClusterKVIndex, fed by an engine host's routing-stats reports: kv_feed.py)
equals the engine's real holdings in every tier - the device block pool and the offload tier's index - after
each workload: prefills and decodes with preemption, eviction that spills to the tier, reloads from it, and
an engine restart over the same tier; and every block of every tier is accounted for after each (one
process, no Ray: the engine deployment's body on a tiny model)."""

from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace

from pagedserve.cluster.serve.engine_host import EngineHost
from pagedserve.cluster.serve.kv_feed import key_of
from pagedserve.cluster.serve.kv_index import ClusterKVIndex
from pagedserve.engine.core.kv_events import DEVICE
from tests.offload_checks import check_all_blocks

BS = 4
PARAMS = dict(max_tokens=24, temperature=0, ignore_eos=True)


def _host(model, tier_dir) -> EngineHost:
    # 20 blocks, up to 4 sequences of ~60 tokens: they cannot all stay, so the scheduler preempts.
    return EngineHost({"model": str(model), "dtype": "float32", "num_kv_blocks": 20, "block_size": BS,
                       "max_num_batched_tokens": 64, "max_num_seqs": 4, "kv_offload_size": "8MiB",
                       "kv_offload_dir": str(tier_dir)})


def _core(host: EngineHost):
    return host.engine.engine.engine_core


def _wait_idle(host: EngineHost, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while True:
        stats = host.engine.get_stats().scheduler
        if stats.num_free_blocks == stats.num_total_blocks and not stats.num_running and not stats.num_waiting:
            return
        assert time.monotonic() < end, f"blocks still in use: {stats}"
        time.sleep(0.05)


async def _run(host: EngineHost, prompts: list[tuple[list[int], str | None]], tag: str) -> list:
    async def one(i: int, prompt: list[int], salt: str | None):
        return [o async for o in host.generate(f"{tag}{i}", prompt, PARAMS, final_only=True, cache_salt=salt)][-1]
    return await asyncio.gather(*(one(i, p, s) for i, (p, s) in enumerate(prompts)))


def _check(index: ClusterKVIndex, host: EngineHost, phase: str) -> tuple[int, int]:
    """Once the engine is idle and its tier writers caught up: the view the next report gives equals the
    device pool and the tier's index, and every block of both tiers is accounted for."""
    _wait_idle(host)
    state = _core(host).kv_offload_state()  # (waits for every rank's writer)
    report = asyncio.run(host.record_routing_stats())["kv_events"]
    view = index.update("replica", report, time.monotonic())
    assert view.fresh, (phase, view.stale)
    pool = {key_of(h) for h in _core(host).kv_cache_manager.block_pool.cached_block_hash_to_block}
    assert view.tiers.get(DEVICE, set()) == pool, phase
    offloaded = set().union(*(held for tier, held in view.tiers.items() if tier != DEVICE))
    assert offloaded == {key_of(h) for h in state["index"]}, phase
    check_all_blocks(SimpleNamespace(llm_engine=host.engine.engine))
    return len(pool), len(offloaded)


def test_the_index_equals_every_tier_after_each_workload(tiny_llama, tmp_path):
    rng = random.Random(11)
    tokens = lambda n: [rng.randrange(8, 400) for _ in range(n)]  # noqa: E731
    tenants = [(tokens(8 * BS), "tenant-a" if i % 2 else None) for i in range(4)]
    index = ClusterKVIndex()
    host = _host(tiny_llama, tmp_path / "tier")
    try:
        _check(index, host, "empty")
        # Prefill + decode of four long requests at once in 20 blocks: preemption.
        asyncio.run(_run(host, [(p + tokens(6), s) for p, s in tenants], "a"))
        assert _core(host).scheduler.num_preemptions > 0
        _check(index, host, "prefill, decode, preemption")
        # Unrelated prompts evict the tenants' blocks, which spill to the tier.
        asyncio.run(_run(host, [(tokens(40), None) for _ in range(3)], "b"))
        assert host.engine.get_stats().scheduler.kv_offload["stored_blocks"] > 0
        assert min(_check(index, host, "eviction, offload")) > 0  # (both tiers hold blocks: nothing trivial)
        # The tenants come back one at a time: their prefixes reload from the tier.
        for i, (prefix, salt) in enumerate(tenants):
            out = asyncio.run(_run(host, [(prefix + tokens(3), salt)], f"c{i}-"))
            assert out[0].num_cached_tokens > 0
        assert host.engine.get_stats().scheduler.kv_offload["hit_tokens"] > 0
        _check(index, host, "reload")
        # A restarted engine over the same tier: a new incarnation, followed from its first report.
        host.shutdown()
        host = _host(tiny_llama, tmp_path / "tier")
        _check(index, host, "restart")
        assert index.counters.restarts == 1
        asyncio.run(_run(host, [(p + tokens(2), s) for p, s in tenants[:2]], "d"))
        _check(index, host, "after the restart")
    finally:
        host.shutdown()

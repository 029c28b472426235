"""Exact routing over real engine replicas in one process (the engine deployment's body, its routing
stats with KV events, the Serve request router), no Ray: with KV demand above one engine's cache and
evictions happening, requests land where their prefix still is, the engines find the cached tokens the
router predicted (the engines' own prefix-cache hit counters agree), and the router's index equals every
engine's block pool after the workload, a prefix cache reset and an engine restart; the in-process
coordinator, which runs the same chooser, predicts as well."""

from __future__ import annotations

import asyncio
import random
import time

from pagedserve.cluster.serve.engine_host import EngineHost
from pagedserve.cluster.serve.kv_feed import key_of
from pagedserve.cluster.serve.routing_policy import EXACT_HIT
from pagedserve.engine.core.kv_events import DEVICE, REMOVED
from tests.test_serve_router import make_router

BLOCK = 4
PARAMS = dict(max_tokens=4, temperature=0, ignore_eos=True)


def _engine(model) -> EngineHost:
    # 52 blocks = 208 tokens each: the tenants' prefixes alone (10 x 6 blocks) exceed one engine.
    return EngineHost({"model": str(model), "dtype": "float32", "num_kv_blocks": 52, "block_size": BLOCK,
                             "max_num_seqs": 4})


def _pool_keys(engine: EngineHost) -> set[bytes]:
    pool = engine.engine.engine.engine_core.kv_cache_manager.block_pool
    return {key_of(h) for h in pool.cached_block_hash_to_block}


def _wait_all_free(engine: EngineHost, deadline_s: float = 30.0) -> None:
    """Every block free once the engine thread has posted the stats of the step that finished the last
    request (the output reaches the caller just before)."""
    end = time.monotonic() + deadline_s
    while True:
        stats = engine.engine.get_stats().scheduler
        if stats.num_free_blocks == stats.num_total_blocks:
            return
        assert time.monotonic() < end, f"blocks still in use: {stats}"
        time.sleep(0.05)


async def _refresh(replicas, engines) -> None:
    """One round of Serve's `record_routing_stats`, broadcast to the router."""
    for replica, engine in zip(replicas, engines):
        replica.routing_stats = await engine.record_routing_stats()


async def _serve(router, replicas, engines, rid: str, prompt: list[int], salt: str | None) -> tuple[int, int]:
    choice = router.choose(replicas, prompt, salt, rid)
    engine = engines[replicas.index(choice)]
    outputs = [o async for o in engine.generate(rid, prompt, PARAMS, final_only=True, cache_salt=salt)]
    found = outputs[-1].num_cached_tokens
    predicted = router.predictions[rid]
    router.observe_cached(rid, found)
    return predicted, found


def test_exact_routing_predicts_what_the_engines_find_and_the_index_matches_their_pools(tiny_llama):
    """One request at a time, the routing stats refreshed after each (Serve does it every period). Two
    requests at once may reach their engine in either order, and the first one's new blocks can evict the
    least recently used prefix, the very one the second came back for: a prediction that no report could
    have got right."""
    engines = [_engine(tiny_llama), _engine(tiny_llama)]
    router, replicas = make_router(2)
    rng = random.Random(5)
    tenants = [([rng.randrange(20, 400) for _ in range(6 * BLOCK)], f"t{i}" if i % 2 else None) for i in range(10)]

    async def workload() -> list[tuple[int, int]]:
        results = []
        await _refresh(replicas, engines)
        for n in range(60):
            prefix, salt = tenants[rng.randrange(len(tenants))]
            prompt = prefix + [rng.randrange(20, 400) for _ in range(rng.randrange(2, 9))]
            results.append(await _serve(router, replicas, engines, f"q{n}", prompt, salt))
            await _refresh(replicas, engines)
        return results

    try:
        results = asyncio.run(workload())
        matched = sum(p == f for p, f in results)
        assert matched >= 0.95 * len(results), ([(i, r) for i, r in enumerate(results) if r[0] != r[1]], router.policy.decisions, router.index.counters)
        assert router.prediction_counters.checked == len(results)
        assert router.policy.decisions[EXACT_HIT] >= len(results) // 3  # tenants came back to their prefix
        assert sum(f for _, f in results) > 0
        # The engines' own prefix-cache hit counters saw what the requests report finding.
        assert sum(e.engine.get_stats().scheduler.prefix_cache_hits for e in engines) == sum(f for _, f in results)
        logs = [e.engine.engine.engine_core.kv_events for e in engines]
        evictions = [sum(len(ev.block_hashes) for b in log.since(0) for ev in b.events if ev.kind == REMOVED)
                     for log in logs]
        assert sum(evictions) > 0, "the workload was meant to evict"
        router._sync_index(replicas)  # (the last broadcast: no request has made the router read it yet)
        for replica, engine in zip(replicas, engines):
            view = router.index.views[replica.replica_id]
            assert view.fresh and view.tiers.get(DEVICE, set()) == _pool_keys(engine)
            _wait_all_free(engine)

        # A prefix-cache reset: the cleared event empties that engine's view.
        assert engines[0].engine.engine.reset_prefix_cache()
        asyncio.run(_refresh(replicas, engines))
        router._sync_index(replicas)
        assert router.index.views[replicas[0].replica_id].tiers.get(DEVICE, set()) == set()

        # A restarted engine: a new incarnation, followed from its first report.
        engines[1].shutdown()
        engines[1] = _engine(tiny_llama)
        prefix, salt = tenants[0]

        async def after_restart() -> None:
            await _refresh(replicas, engines)
            router._sync_index(replicas)
            await _serve(router, replicas, engines, "after", prefix + [1, 2], salt)
            await _refresh(replicas, engines)

        asyncio.run(after_restart())
        router._sync_index(replicas)
        assert router.index.counters.restarts == 1
        for replica, engine in zip(replicas, engines):
            view = router.index.views[replica.replica_id]
            assert view.fresh and view.tiers.get(DEVICE, set()) == _pool_keys(engine)
    finally:
        for engine in engines:
            engine.shutdown()


def test_concurrent_requests_are_predicted_too(tiny_llama):
    """Waves of two requests at once (one tenant twice at times), the stats refreshed between waves: the
    router counts its own routes of the wave as held (RecentRoutes) until the next report."""
    engines = [_engine(tiny_llama), _engine(tiny_llama)]
    router, replicas = make_router(2)
    rng = random.Random(5)
    tenants = [([rng.randrange(20, 400) for _ in range(6 * BLOCK)], f"t{i}" if i % 2 else None) for i in range(10)]

    async def workload() -> list[tuple[int, int]]:
        results: list[tuple[int, int]] = []
        await _refresh(replicas, engines)
        for wave in range(30):
            batch = []
            for j in range(2):
                prefix, salt = tenants[rng.randrange(len(tenants))]
                prompt = prefix + [rng.randrange(20, 400) for _ in range(rng.randrange(2, 9))]
                batch.append(_serve(router, replicas, engines, f"w{wave}-{j}", prompt, salt))
            results += await asyncio.gather(*batch)
            await _refresh(replicas, engines)
        return results

    try:
        results = asyncio.run(workload())
        assert sum(p == f for p, f in results) >= 0.95 * len(results), results
        assert router.policy.decisions[EXACT_HIT] >= len(results) // 3
    finally:
        for engine in engines:
            engine.shutdown()


def test_the_in_process_coordinator_predicts_what_the_engines_find(tiny_llama):
    """The same workload through `DPCoordinator` (the in-process PD pools' router), which polls the engines'
    routing stats itself and runs the Serve router's chooser: its predictions match the engines' hits."""
    from pagedserve.cluster.serve.coordinator import DPCoordinator
    from tests.local_serving import LocalHandle

    engines = [_engine(tiny_llama), _engine(tiny_llama)]
    coord = DPCoordinator([LocalHandle(e) for e in engines], block_size=BLOCK, seed=0)
    rng = random.Random(5)
    tenants = [([rng.randrange(20, 400) for _ in range(6 * BLOCK)], f"t{i}" if i % 2 else None) for i in range(10)]

    async def workload() -> int:
        found = 0
        await coord.refresh_stats()
        for n in range(60):
            prefix, salt = tenants[rng.randrange(len(tenants))]
            prompt = prefix + [rng.randrange(20, 400) for _ in range(rng.randrange(2, 9))]
            outputs = [o async for o in coord.generate(f"q{n}", prompt, PARAMS, final_only=True, cache_salt=salt)]
            found += outputs[-1].num_cached_tokens
            await coord.refresh_stats()
        return found

    try:
        found = asyncio.run(workload())
        counters = coord.chooser.prediction_counters
        assert counters.checked == 60 and counters.matched >= 0.95 * 60, (counters, coord.policy.decisions)
        assert counters.actual_tokens == found == sum(e.engine.get_stats().scheduler.prefix_cache_hits
                                                      for e in engines) > 0
        assert coord.policy.decisions[EXACT_HIT] >= 20
        for state, engine in zip(coord.engines, engines):
            view = coord.chooser.index.views[state.index]
            assert view.fresh and view.tiers.get(DEVICE, set()) == _pool_keys(engine)
    finally:
        for engine in engines:
            engine.shutdown()

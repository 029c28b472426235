"""DPCoordinator routing and request bookkeeping with fake engine handles (no Ray)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from ray.exceptions import RayTaskError

from pagedserve.cluster.serve.coordinator import DPCoordinator
from pagedserve.engine.async_llm import EngineDeadError, EngineOverloadedError
from tests.coordinator_fakes import FakeEngine, Method, engine_stats, make_coordinator, make_prompt, raising


# ---------------------------------------------------------------------- choose_engine


def test_unrelated_prompts_spread_over_engines():
    coord, _ = make_coordinator(4)
    picks = Counter()
    for i in range(200):
        index = coord.choose_engine(make_prompt(i))
        coord.engines[index].in_flight += 1  # as generate() would while requests are in flight
        picks[index] += 1
    assert set(picks) == {0, 1, 2, 3}
    assert max(picks.values()) - min(picks.values()) <= 2  # two choices by load keeps it balanced


def test_least_loaded_engine_wins_with_two_engines():
    coord, _ = make_coordinator(2)
    coord.engines[0].stats = engine_stats(0, running=5, waiting=3)
    coord.engines[1].stats = engine_stats(1, running=1)
    assert all(coord.choose_engine(make_prompt(i)) == 1 for i in range(20))
    coord.engines[1].stats = engine_stats(1, running=1, usage=1.0)  # nearly equal counts, but a full KV cache
    coord.engines[0].stats = engine_stats(0, running=2)
    # (fresh prompts: a choice remembers where its prefix went, as the Serve router's does)
    assert all(coord.choose_engine(make_prompt(i)) == 0 for i in range(20, 40))


def test_prefix_affinity_routes_shared_prefix_to_same_engine():
    coord, _ = make_coordinator(4, seed=3)
    shared = make_prompt(1, length=16)
    first = coord.choose_engine(shared + [9, 9, 9])
    coord.policy.remember(coord.prefix_hashes(shared + [9, 9, 9]), first)
    # Make the affinity engine somewhat busier than the rest: still within the imbalance bound.
    coord.engines[first].stats = engine_stats(first, running=1)
    for tail in range(10):
        assert coord.choose_engine(shared + [tail, 5, 6, 7, 8]) == first


def test_longest_known_prefix_wins():
    coord, _ = make_coordinator(3)
    p = make_prompt(2, length=16)
    coord.policy.remember(coord.prefix_hashes(p[:4]), 0)  # one block known on engine 0
    coord.policy.remember(coord.prefix_hashes(p[:12]), 2)  # three blocks known on engine 2 (overwrites block 1 -> 2)
    coord.policy.remember(coord.prefix_hashes(p[:4]), 0)
    assert coord.policy.sent_to([0, 1, 2], coord.prefix_hashes(p)) == 2
    assert coord.policy.sent_to([0, 1, 2], coord.prefix_hashes(p[:4] + [1, 1, 1, 1])) == 0


def test_imbalance_overrides_affinity():
    coord, _ = make_coordinator(2, imbalance_factor=2.0)
    p = make_prompt(3)
    coord.policy.remember(coord.prefix_hashes(p), 0)
    coord.engines[0].stats = engine_stats(0, running=4)  # 4 <= 2 * 1 + 2 (slack): affinity holds
    coord.engines[1].stats = engine_stats(1, running=1)
    assert coord.choose_engine(p) == 0
    coord.engines[0].stats = engine_stats(0, running=5)  # 5 > 4: much busier, go to the other engine
    assert coord.choose_engine(p) == 1


def test_short_prompt_has_no_affinity():
    coord, _ = make_coordinator(2)
    assert coord.prefix_hashes([1, 2, 3]) == []
    assert len(coord.prefix_hashes(list(range(100)))) == 4  # capped at affinity_blocks


def test_unhealthy_and_dead_engines_are_skipped():
    coord, _ = make_coordinator(3)
    p = make_prompt(4)
    coord.policy.remember(coord.prefix_hashes(p), 0)
    coord.engines[0].available = False  # dead actor, even though it holds the prefix
    coord.engines[1].stats = engine_stats(1, healthy=False)  # stalled
    coord.engines[2].stats = engine_stats(2, running=50)
    assert all(coord.choose_engine(make_prompt(i)) == 2 for i in range(30))
    assert coord.choose_engine(p) == 2


def test_no_healthy_engine_falls_back_to_reachable():
    coord, _ = make_coordinator(2)
    coord.engines[0].available = False
    coord.engines[1].stats = engine_stats(1, healthy=False)
    assert coord.choose_engine(make_prompt(0)) == 1


def test_affinity_map_is_bounded():
    coord, _ = make_coordinator(2, max_affinity_entries=8)
    for i in range(20):
        coord.policy.remember(coord.prefix_hashes(make_prompt(i)), i % 2)
    assert len(coord.policy._affinity) == 8


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="engines"):
        DPCoordinator([], block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        DPCoordinator([FakeEngine(0)], block_size=0)
    with pytest.raises(ValueError, match="imbalance_factor"):
        DPCoordinator([FakeEngine(0)], block_size=4, imbalance_factor=0.5)


# ---------------------------------------------------------------------- generate / stats with fakes


def test_generate_streams_and_counts():
    coord, engines = make_coordinator(2)

    async def run():
        outs = [o async for o in coord.generate("r1", make_prompt(0), {"max_tokens": 5})]
        return outs

    outs = asyncio.run(run())
    assert [o.outputs[0].token_ids[0] for o in outs] == [0, 1, 2, 3, 4]
    assert outs[-1].finished
    stats = coord.aggregate_stats()
    assert sum(stats.num_requests_routed) == 1 and stats.num_in_flight == 0
    assert all(not e.aborted for e in engines)  # finished normally: nothing to abort


def test_consumer_stopping_early_aborts_on_engine():
    coord, engines = make_coordinator(2)

    async def run():
        agen = coord.generate("early", make_prompt(0), {})
        async for _ in agen:
            break
        await agen.aclose()

    asyncio.run(run())
    assert sum(e.aborted.count("early") for e in engines) == 1
    assert coord.aggregate_stats().num_in_flight == 0


def test_dead_engine_fails_only_its_request_and_is_routed_around():
    coord, engines = make_coordinator(2)
    engines[0].die_after = 2

    async def collect(rid):
        return [o async for o in coord.generate(rid, make_prompt(len(rid)), {})]

    async def run():
        results = await asyncio.gather(collect("a"), collect("bb"), return_exceptions=True)
        return results

    results = asyncio.run(run())
    by_engine = {rid: i for i, e in enumerate(engines) for rid in e.requests}
    assert by_engine["a"] != by_engine["bb"]  # two choices put them on different engines
    for rid, res in zip(["a", "bb"], results):
        if by_engine[rid] == 0:
            assert isinstance(res, EngineDeadError) and "engine 0" in str(res)
        else:
            assert isinstance(res, list) and res[-1].finished
    assert not coord.engines[0].available
    assert all(coord.choose_engine(make_prompt(i)) == 1 for i in range(20))


def test_engine_error_cause_is_unwrapped():
    coord, engines = make_coordinator(1)
    wrapped = RayTaskError("generate", "traceback", ValueError("prompt: too long"))

    async def failing(*args, **kwargs):
        yield raising(wrapped)

    engines[0].generate = Method(failing)

    async def run():
        return [o async for o in coord.generate("x", make_prompt(0), {})]

    with pytest.raises(ValueError, match="prompt: too long"):
        asyncio.run(run())
    assert coord.engines[0].available  # bad input does not mark the engine dead


def _refusing(engine: FakeEngine):
    """generate.remote for an engine whose request queue is full (the error arrives wrapped, as from Ray)."""

    async def refuse(request_id, *args, **kwargs):
        engine.requests.append(request_id)
        yield raising(RayTaskError("generate", "traceback", EngineOverloadedError("queue full")))

    return Method(refuse)


def test_overloaded_engine_is_skipped_for_another():
    coord, engines = make_coordinator(3)
    engines[0].generate = _refusing(engines[0])
    engines[1].generate = _refusing(engines[1])

    async def run():
        results = []
        for i in range(6):  # (a loop: an async comprehension inside a comprehension needs Python 3.11)
            results.append([o async for o in coord.generate(f"r{i}", make_prompt(i), {})])
        return results

    results = asyncio.run(run())
    assert all(outs[-1].finished and len(outs) == 5 for outs in results)
    assert sorted(engines[2].requests) == [f"r{i}" for i in range(6)]  # every request ended up on engine 2
    stats = coord.aggregate_stats()
    assert stats.num_in_flight == 0 and all(e.available for e in coord.engines)


def test_overload_reaches_the_caller_when_every_engine_refuses():
    coord, engines = make_coordinator(2)
    for engine in engines:
        engine.generate = _refusing(engine)

    async def run():
        return [o async for o in coord.generate("full", make_prompt(0), {})]

    with pytest.raises(EngineOverloadedError, match="queue full"):
        asyncio.run(run())
    assert [e.requests for e in engines] == [["full"], ["full"]]  # each tried once
    assert coord.aggregate_stats().num_in_flight == 0


def test_refresh_stats_marks_dead_and_recovers_and_counters_stay_monotonic():
    coord, engines = make_coordinator(2)
    engines[0].stats = engine_stats(0, running=2, num_generation_tokens=100, num_preemptions=1)
    engines[1].stats = engine_stats(1, running=1, num_generation_tokens=50)

    async def run():
        await coord.refresh_stats()
        first = coord.aggregate_stats()
        engines[0].die_after = -1  # get_stats now raises ActorDiedError
        polled = await coord.refresh_stats()
        during = (coord.aggregate_stats(), coord.is_healthy(), polled)
        engines[0].die_after = None  # restarted: counters start again from zero
        engines[0].stats = engine_stats(0, running=0, num_generation_tokens=10, incarnation="second")
        await coord.refresh_stats()
        return first, during, coord.aggregate_stats()

    first, (during, healthy_during, polled), after = asyncio.run(run())
    assert first.num_running == 3 and first.num_generation_tokens == 150
    assert polled[0] is None and polled[1] is not None  # engine 0 did not answer
    assert not during.engines[0].available and not during.engines[0].healthy
    assert during.num_healthy_engines == 1 and during.num_running == 1
    assert healthy_during  # one engine is still reachable and not stalled
    assert after.num_healthy_engines == 2
    assert after.num_generation_tokens == 160  # 100 before the restart + 10 after + 50
    assert after.num_preemptions == 1


def test_is_healthy_false_when_an_engine_stalls_or_none_is_reachable():
    coord, _ = make_coordinator(2)
    assert coord.is_healthy()
    coord.engines[1].stats = engine_stats(1, running=3, healthy=False)
    assert not coord.is_healthy()
    coord.engines[1].stats = engine_stats(1)
    for e in coord.engines:
        e.available = False
    assert not coord.is_healthy()


def test_background_polling_starts_and_stops():
    coord, engines = make_coordinator(2, stats_interval_s=0.01)
    engines[1].stats = engine_stats(1, waiting=7)

    async def run():
        coord.start()
        for _ in range(200):
            await asyncio.sleep(0.01)
            if coord.engines[1].stats is not None:
                break
        await coord.stop()
        return coord.aggregate_stats()

    assert asyncio.run(run()).num_waiting == 7


def test_late_stale_stats_answer_is_ignored():
    coord, engines = make_coordinator(1)

    async def run():
        engines[0].stats = engine_stats(0, running=2, num_generation_tokens=105, stats_time=2.0)
        await coord.refresh_stats()
        engines[0].stats = engine_stats(0, running=5, num_generation_tokens=100, stats_time=1.0)  # sent earlier
        await coord.refresh_stats()
        return coord.aggregate_stats()

    agg = asyncio.run(run())
    assert agg.num_generation_tokens == 105 and agg.num_running == 2

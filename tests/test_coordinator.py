"""DPCoordinator routing and request bookkeeping with fake engine handles (no Ray)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from pagedserve.cluster.coordinator import DPCoordinator
from pagedserve.cluster.stream_transport import PromptElider
from pagedserve.engine.async_llm import EngineDeadError, EngineOverloadedError
from pagedserve.engine.outputs import CompletionOutput, RequestOutput

BLOCK = 4


def _stats(index: int, running: int = 0, waiting: int = 0, usage: float = 0.0, healthy: bool = True, **extra) -> dict:
    base = dict(engine_index=index, num_running=running, num_waiting=waiting, kv_cache_usage=usage,
                num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0, num_free_blocks=100,
                num_total_blocks=100, num_prompt_tokens=0, num_generation_tokens=0, healthy=healthy,
                last_step_age_s=0.0, incarnation="first", stats_time=0.0)
    base.update(extra)
    return base


def _output(request_id: str, tokens: list[int], finish: str | None, prompt_ids: list[int] | None = None) -> RequestOutput:
    comp = CompletionOutput(index=0, text="", token_ids=tokens, cumulative_logprob=None, logprobs=None,
                            finish_reason=finish)
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=list(prompt_ids or []),
                         prompt_logprobs=None, outputs=[comp], finished=finish is not None)


class _Done:
    """An awaitable that is already resolved (like a finished ObjectRef); never warns when left unawaited."""

    def __init__(self, value) -> None:
        self.value = value

    def __await__(self):
        return self.value
        yield  # makes this a generator function


def _ready(value):
    return _Done(value)


async def _raise(exc: BaseException):
    raise exc


class _Method:
    def __init__(self, fn):
        self.remote = fn


class FakeEngine:
    """Mimics an engine actor handle: generate.remote() yields awaitables like a Ray ObjectRefGenerator."""

    def __init__(self, index: int, num_tokens: int = 5, die_after: int | None = None) -> None:
        self.index = index
        self.num_tokens = num_tokens
        self.die_after = die_after
        self.stats = _stats(index)
        self.aborted: list[str] = []
        self.abort_rpcs = 0  # abort calls of either kind: one RPC each on a real actor
        self.requests: list[str] = []
        self.generate = _Method(self._generate)
        self.abort = _Method(lambda rid: self._abort([rid]))
        self.abort_requests = _Method(self._abort)
        self.get_stats = _Method(self._get_stats)

    def _abort(self, request_ids):
        self.abort_rpcs += 1
        self.aborted.extend(request_ids)
        return _ready(None)

    async def _generate(self, request_id, prompt, sampling_params, priority=0):
        """Like the real actor: the prompt travels in the first output only (PromptElider)."""
        self.requests.append(request_id)
        elide = PromptElider()
        for i in range(self.num_tokens):
            if self.die_after is not None and i == self.die_after:
                yield _raise(ActorDiedError())
                return
            finish = "length" if i == self.num_tokens - 1 else None
            yield _ready(elide(_output(request_id, [i], finish, prompt["prompt_token_ids"])))
            await asyncio.sleep(0)

    def _get_stats(self):
        if self.die_after is not None and self.die_after < 0:
            return _raise(ActorDiedError())
        return _ready(dict(self.stats))


def _coordinator(n: int, **kw) -> tuple[DPCoordinator, list[FakeEngine]]:
    engines = [FakeEngine(i) for i in range(n)]
    return DPCoordinator(engines, block_size=BLOCK, **kw), engines


def _prompt(seed: int, length: int = 20) -> list[int]:
    return [(seed * 131 + 7 * i) % 500 + 3 for i in range(length)]


# ---------------------------------------------------------------------- choose_engine


def test_unrelated_prompts_spread_over_engines():
    coord, _ = _coordinator(4)
    picks = Counter()
    for i in range(200):
        index = coord.choose_engine(_prompt(i))
        coord.engines[index].in_flight += 1  # as generate() would while requests are in flight
        picks[index] += 1
    assert set(picks) == {0, 1, 2, 3}
    assert max(picks.values()) - min(picks.values()) <= 2  # two choices by load keeps it balanced


def test_least_loaded_engine_wins_with_two_engines():
    coord, _ = _coordinator(2)
    coord.engines[0].stats = _stats(0, running=5, waiting=3)
    coord.engines[1].stats = _stats(1, running=1)
    assert all(coord.choose_engine(_prompt(i)) == 1 for i in range(20))
    coord.engines[1].stats = _stats(1, running=1, usage=1.0)  # nearly equal counts, but a full KV cache
    coord.engines[0].stats = _stats(0, running=2)
    assert all(coord.choose_engine(_prompt(i)) == 0 for i in range(20))


def test_prefix_affinity_routes_shared_prefix_to_same_engine():
    coord, _ = _coordinator(4, seed=3)
    shared = _prompt(1, length=16)
    first = coord.choose_engine(shared + [9, 9, 9])
    coord._remember_prefix(shared + [9, 9, 9], first)
    # Make the affinity engine somewhat busier than the rest: still within the imbalance bound.
    coord.engines[first].stats = _stats(first, running=1)
    for tail in range(10):
        assert coord.choose_engine(shared + [tail, 5, 6, 7, 8]) == first


def test_longest_known_prefix_wins():
    coord, _ = _coordinator(3)
    p = _prompt(2, length=16)
    coord._remember_prefix(p[:4], 0)  # one block known on engine 0
    coord._remember_prefix(p[:12], 2)  # three blocks known on engine 2 (overwrites block 1 -> 2)
    coord._remember_prefix(p[:4], 0)
    assert coord._affinity_engine(p, coord._candidates()).index == 2
    assert coord._affinity_engine(p[:4] + [1, 1, 1, 1], coord._candidates()).index == 0


def test_imbalance_overrides_affinity():
    coord, _ = _coordinator(2, imbalance_factor=2.0)
    p = _prompt(3)
    coord._remember_prefix(p, 0)
    coord.engines[0].stats = _stats(0, running=3)  # 3 <= 2 * 1 + 1: affinity holds
    coord.engines[1].stats = _stats(1, running=1)
    assert coord.choose_engine(p) == 0
    coord.engines[0].stats = _stats(0, running=4)  # 4 > 3: much busier, go to the other engine
    assert coord.choose_engine(p) == 1


def test_short_prompt_has_no_affinity():
    coord, _ = _coordinator(2)
    assert coord.prefix_hashes([1, 2, 3]) == []
    assert len(coord.prefix_hashes(list(range(100)))) == 4  # capped at affinity_blocks


def test_unhealthy_and_dead_engines_are_skipped():
    coord, _ = _coordinator(3)
    p = _prompt(4)
    coord._remember_prefix(p, 0)
    coord.engines[0].available = False  # dead actor, even though it holds the prefix
    coord.engines[1].stats = _stats(1, healthy=False)  # stalled
    coord.engines[2].stats = _stats(2, running=50)
    assert all(coord.choose_engine(_prompt(i)) == 2 for i in range(30))
    assert coord.choose_engine(p) == 2


def test_no_healthy_engine_falls_back_to_reachable():
    coord, _ = _coordinator(2)
    coord.engines[0].available = False
    coord.engines[1].stats = _stats(1, healthy=False)
    assert coord.choose_engine(_prompt(0)) == 1


def test_affinity_map_is_bounded():
    coord, _ = _coordinator(2, max_affinity_entries=8)
    for i in range(20):
        coord._remember_prefix(_prompt(i), i % 2)
    assert len(coord._affinity) == 8


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="engines"):
        DPCoordinator([], block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        DPCoordinator([FakeEngine(0)], block_size=0)
    with pytest.raises(ValueError, match="imbalance_factor"):
        DPCoordinator([FakeEngine(0)], block_size=4, imbalance_factor=0.5)


# ---------------------------------------------------------------------- generate / stats with fakes


def test_generate_streams_and_counts():
    coord, engines = _coordinator(2)

    async def run():
        outs = [o async for o in coord.generate("r1", _prompt(0), {"max_tokens": 5})]
        return outs

    outs = asyncio.run(run())
    assert [o.outputs[0].token_ids[0] for o in outs] == [0, 1, 2, 3, 4]
    assert outs[-1].finished
    stats = coord.aggregate_stats()
    assert sum(stats["num_requests_routed"]) == 1 and stats["num_in_flight"] == 0
    assert all(not e.aborted for e in engines)  # finished normally: nothing to abort


def test_consumer_stopping_early_aborts_on_engine():
    coord, engines = _coordinator(2)

    async def run():
        agen = coord.generate("early", _prompt(0), {})
        async for _ in agen:
            break
        await agen.aclose()

    asyncio.run(run())
    assert sum(e.aborted.count("early") for e in engines) == 1
    assert coord.aggregate_stats()["num_in_flight"] == 0


def test_dead_engine_fails_only_its_request_and_is_routed_around():
    coord, engines = _coordinator(2)
    engines[0].die_after = 2

    async def collect(rid):
        return [o async for o in coord.generate(rid, _prompt(len(rid)), {})]

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
    assert all(coord.choose_engine(_prompt(i)) == 1 for i in range(20))


def test_engine_error_cause_is_unwrapped():
    coord, engines = _coordinator(1)
    wrapped = RayTaskError("generate", "traceback", ValueError("prompt: too long"))

    async def failing(*args, **kwargs):
        yield _raise(wrapped)

    engines[0].generate = _Method(failing)

    async def run():
        return [o async for o in coord.generate("x", _prompt(0), {})]

    with pytest.raises(ValueError, match="prompt: too long"):
        asyncio.run(run())
    assert coord.engines[0].available  # bad input does not mark the engine dead


def _refusing(engine: FakeEngine):
    """generate.remote for an engine whose request queue is full (the error arrives wrapped, as from Ray)."""

    async def refuse(request_id, *args, **kwargs):
        engine.requests.append(request_id)
        yield _raise(RayTaskError("generate", "traceback", EngineOverloadedError("queue full")))

    return _Method(refuse)


def test_overloaded_engine_is_skipped_for_another():
    coord, engines = _coordinator(3)
    engines[0].generate = _refusing(engines[0])
    engines[1].generate = _refusing(engines[1])

    async def run():
        return [[o async for o in coord.generate(f"r{i}", _prompt(i), {})] for i in range(6)]

    results = asyncio.run(run())
    assert all(outs[-1].finished and len(outs) == 5 for outs in results)
    assert sorted(engines[2].requests) == [f"r{i}" for i in range(6)]  # every request ended up on engine 2
    stats = coord.aggregate_stats()
    assert stats["num_in_flight"] == 0 and all(e.available for e in coord.engines)


def test_overload_reaches_the_caller_when_every_engine_refuses():
    coord, engines = _coordinator(2)
    for engine in engines:
        engine.generate = _refusing(engine)

    async def run():
        return [o async for o in coord.generate("full", _prompt(0), {})]

    with pytest.raises(EngineOverloadedError, match="queue full"):
        asyncio.run(run())
    assert [e.requests for e in engines] == [["full"], ["full"]]  # each tried once
    assert coord.aggregate_stats()["num_in_flight"] == 0


def test_refresh_stats_marks_dead_and_recovers_and_counters_stay_monotonic():
    coord, engines = _coordinator(2)
    engines[0].stats = _stats(0, running=2, num_generation_tokens=100, num_preemptions=1)
    engines[1].stats = _stats(1, running=1, num_generation_tokens=50)

    async def run():
        await coord.refresh_stats()
        first = coord.aggregate_stats()
        engines[0].die_after = -1  # get_stats now raises ActorDiedError
        polled = await coord.refresh_stats()
        during = (coord.aggregate_stats(), coord.is_healthy(), polled)
        engines[0].die_after = None  # restarted: counters start again from zero
        engines[0].stats = _stats(0, running=0, num_generation_tokens=10, incarnation="second")
        await coord.refresh_stats()
        return first, during, coord.aggregate_stats()

    first, (during, healthy_during, polled), after = asyncio.run(run())
    assert first["num_running"] == 3 and first["num_generation_tokens"] == 150
    assert polled[0]["healthy"] is False and polled[0]["reachable"] is False
    assert during["num_healthy_engines"] == 1 and during["num_running"] == 1
    assert healthy_during  # one engine is still reachable and not stalled
    assert after["num_healthy_engines"] == 2
    assert after["num_generation_tokens"] == 160  # 100 before the restart + 10 after + 50
    assert after["num_preemptions"] == 1


def test_is_healthy_false_when_an_engine_stalls_or_none_is_reachable():
    coord, _ = _coordinator(2)
    assert coord.is_healthy()
    coord.engines[1].stats = _stats(1, running=3, healthy=False)
    assert not coord.is_healthy()
    coord.engines[1].stats = _stats(1)
    for e in coord.engines:
        e.available = False
    assert not coord.is_healthy()


def test_background_polling_starts_and_stops():
    coord, engines = _coordinator(2, stats_interval_s=0.01)
    engines[1].stats = _stats(1, waiting=7)

    async def run():
        coord.start()
        for _ in range(200):
            await asyncio.sleep(0.01)
            if coord.engines[1].stats is not None:
                break
        await coord.stop()
        return coord.aggregate_stats()

    assert asyncio.run(run())["num_waiting"] == 7


def test_late_stale_stats_answer_is_ignored():
    coord, engines = _coordinator(1)

    async def run():
        engines[0].stats = _stats(0, running=2, num_generation_tokens=105, stats_time=2.0)
        await coord.refresh_stats()
        engines[0].stats = _stats(0, running=5, num_generation_tokens=100, stats_time=1.0)  # sent earlier
        await coord.refresh_stats()
        return coord.aggregate_stats()

    agg = asyncio.run(run())
    assert agg["num_generation_tokens"] == 105 and agg["num_running"] == 2


# ---------------------------------------------------------------------- stream transport, aborts, stats


def test_prompt_sent_once_by_the_engine_reaches_every_output():
    coord, engines = _coordinator(2)
    prompt = _prompt(5)
    seen: list[list[int]] = []

    async def recording(request_id, prompt_arg, sampling_params, priority=0):
        """What crosses the actor boundary: the prompt in the first output only."""
        engine = engines[0]
        async for ref in engine._generate(request_id, prompt_arg, sampling_params, priority):
            out = await ref
            seen.append(list(out.prompt_token_ids))
            yield _ready(out)

    for engine in engines:
        engine.generate = _Method(recording)

    async def run():
        return [o async for o in coord.generate("p", prompt, {})]

    outs = asyncio.run(run())
    assert seen[0] == prompt and all(ids == [] for ids in seen[1:])  # the wire carries it once
    assert len(outs) == 5 and all(o.prompt_token_ids == prompt for o in outs)  # callers see it every time


def test_mass_disconnect_costs_one_abort_rpc_per_engine():
    coord, engines = _coordinator(2)
    num_streams = 20

    async def run():
        streams = [coord.generate(f"d{i}", _prompt(i), {}) for i in range(num_streams)]
        for stream in streams:
            await stream.__anext__()
        await asyncio.gather(*(stream.aclose() for stream in streams))  # every client leaves at once
        await asyncio.sleep(0)  # the batch goes out on the next loop turn

    asyncio.run(run())
    assert sorted(rid for e in engines for rid in e.aborted) == sorted(f"d{i}" for i in range(num_streams))
    busy = [e for e in engines if e.aborted]
    assert len(busy) == 2  # the requests were spread over both engines ...
    assert all(e.abort_rpcs == 1 for e in busy)  # ... and each got one RPC, not one per request
    assert coord.aggregate_stats()["num_in_flight"] == 0


def test_concurrent_explicit_aborts_share_one_rpc():
    coord, engines = _coordinator(1)

    async def run():
        streams = [coord.generate(f"a{i}", _prompt(i), {}) for i in range(5)]
        for stream in streams:
            await stream.__anext__()
        await asyncio.gather(*(coord.abort(f"a{i}") for i in range(5)))
        rpcs = engines[0].abort_rpcs
        for stream in streams:
            await stream.aclose()
        return rpcs

    assert asyncio.run(run()) == 1
    assert sorted(set(engines[0].aborted)) == [f"a{i}" for i in range(5)]


def test_latest_stats_and_health_answer_from_polled_stats_without_rpc():
    coord, engines = _coordinator(2)
    engines[0].stats = _stats(0, running=2, num_generation_tokens=30)
    engines[1].stats = _stats(1, waiting=1, healthy=False)

    async def run():
        before = coord.latest_stats()
        await coord.refresh_stats()
        for engine in engines:  # from now on an RPC would fail the test
            engine.get_stats = _Method(lambda: pytest.fail("stats accessor made an RPC"))
        return before, coord.latest_stats(), coord.is_healthy()

    before, latest, healthy = asyncio.run(run())
    assert before["stats_age_s"] is None and before["num_running"] == 0
    assert latest["stats_age_s"] is not None and latest["stats_age_s"] >= 0
    assert latest["num_running"] == 2 and latest["num_waiting"] == 1 and latest["num_generation_tokens"] == 30
    assert latest["num_healthy_engines"] == 1 and not healthy

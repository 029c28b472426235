"""DPCoordinator's transport with fake engine handles (no Ray): prompts restored from the first output,
batched aborts, and stats answered without an RPC."""

from __future__ import annotations

import asyncio

import pytest

from tests.coordinator_fakes import Method, engine_stats, make_coordinator, make_prompt, ready


def test_prompt_sent_once_by_the_engine_reaches_every_output():
    coord, engines = make_coordinator(2)
    prompt = make_prompt(5)
    seen: list[list[int]] = []

    async def recording(request_id, prompt_arg, sampling_params, priority=0):
        """What crosses the actor boundary: the prompt in the first output only."""
        engine = engines[0]
        async for ref in engine._generate(request_id, prompt_arg, sampling_params, priority):
            out = await ref
            seen.append(list(out.prompt_token_ids))
            yield ready(out)

    for engine in engines:
        engine.generate = Method(recording)

    async def run():
        return [o async for o in coord.generate("p", prompt, {})]

    outs = asyncio.run(run())
    assert seen[0] == prompt and all(ids == [] for ids in seen[1:])  # the wire carries it once
    assert len(outs) == 5 and all(o.prompt_token_ids == prompt for o in outs)  # callers see it every time


def test_mass_disconnect_costs_one_abort_rpc_per_engine():
    coord, engines = make_coordinator(2)
    num_streams = 20

    async def run():
        streams = [coord.generate(f"d{i}", make_prompt(i), {}) for i in range(num_streams)]
        for stream in streams:
            await stream.__anext__()
        await asyncio.gather(*(stream.aclose() for stream in streams))  # every client leaves at once
        await asyncio.sleep(0)  # the batch goes out on the next loop turn

    asyncio.run(run())
    assert sorted(rid for e in engines for rid in e.aborted) == sorted(f"d{i}" for i in range(num_streams))
    busy = [e for e in engines if e.aborted]
    assert len(busy) == 2  # the requests were spread over both engines ...
    assert all(e.abort_rpcs == 1 for e in busy)  # ... and each got one RPC, not one per request
    assert coord.aggregate_stats().num_in_flight == 0


def test_concurrent_explicit_aborts_share_one_rpc():
    coord, engines = make_coordinator(1)

    async def run():
        streams = [coord.generate(f"a{i}", make_prompt(i), {}) for i in range(5)]
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
    coord, engines = make_coordinator(2)
    engines[0].stats = engine_stats(0, running=2, num_generation_tokens=30)
    engines[1].stats = engine_stats(1, waiting=1, healthy=False)

    async def run():
        before = coord.latest_stats()
        await coord.refresh_stats()
        for engine in engines:  # from now on an RPC would fail the test
            engine.get_stats = Method(lambda: pytest.fail("stats accessor made an RPC"))
        return before, coord.latest_stats(), coord.is_healthy()

    before, latest, healthy = asyncio.run(run())
    assert before.stats_age_s is None and before.num_running == 0
    assert latest.stats_age_s is not None and latest.stats_age_s >= 0
    assert latest.num_running == 2 and latest.num_waiting == 1 and latest.num_generation_tokens == 30
    assert latest.num_healthy_engines == 1 and not healthy

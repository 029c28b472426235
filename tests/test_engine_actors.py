"""Headless engine actors behind the DP coordinator, on a local Ray instance (DP=2, tiny model)."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

ray = pytest.importorskip("ray")

from pagedserve.cluster.engine_stats import EngineStats  # noqa: E402
from pagedserve.cluster.serve.coordinator import DPCoordinator  # noqa: E402
from pagedserve.cluster.serve.engine_actor import start_engine_actors, wait_engines_ready  # noqa: E402
from pagedserve.cluster.serve.engine_host import EngineHost  # noqa: E402
from pagedserve.cluster.serve.stream_transport import STREAM_BACKPRESSURE_OBJECTS  # noqa: E402
from pagedserve.engine import LLM, SamplingParams  # noqa: E402
from pagedserve.engine.async_llm import EngineDeadError  # noqa: E402

BLOCK = 4
PROMPTS = [[(7 * i + 13 * k) % 400 + 10 for k in range(6 + 3 * i)] for i in range(8)]


@pytest.fixture(scope="module")
def engine_kwargs(tiny_llama) -> dict:
    return dict(model=str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", block_size=BLOCK)


@pytest.fixture(scope="module")
def engines(engine_kwargs):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    handles = start_engine_actors(engine_kwargs, data_parallel_size=2, name_prefix="test-dp")
    try:
        infos = wait_engines_ready(handles, timeout_s=300)
        assert [info["engine_index"] for info in infos] == [0, 1]
        assert all(info["block_size"] == BLOCK and info["num_kv_blocks"] > 0 for info in infos)
        assert all(info["device"] == "cpu" for info in infos)  # "auto" on a GPU-less cluster, pinned by the driver
        yield handles
    finally:
        for handle in handles:
            ray.kill(handle, no_restart=True)
        ray.shutdown()


def _run(coro, timeout: float = 120.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _collect(coord: DPCoordinator, request_id: str, prompt: list[int], params: dict) -> list[int]:
    tokens: list[int] = []
    finishes = []
    async for out in coord.generate(request_id, prompt, params):
        assert out.prompt_token_ids == prompt  # restored by the coordinator (the engine sends it once)
        tokens += out.outputs[0].token_ids
        if out.outputs[0].finish_reason is not None:
            finishes.append(out.outputs[0].finish_reason)
    assert len(finishes) == 1  # exactly one delta carries the finish reason
    return tokens


async def wait_coordinator_idle(coord: DPCoordinator) -> list[EngineStats]:
    """Poll until every engine reports no work and all blocks free (or give up and return the last stats)."""
    stats: list[EngineStats | None] = []
    for _ in range(200):
        stats = await coord.refresh_stats()
        if all(s is not None and s.num_running == 0 and s.num_waiting == 0
               and s.num_free_blocks == s.num_total_blocks for s in stats):
            break
        await asyncio.sleep(0.05)
    return stats


def test_dp2_spreads_requests_and_matches_offline_greedy(engines, engine_kwargs):
    params = dict(temperature=0, max_tokens=8, min_tokens=8)

    async def run():
        coord = DPCoordinator(engines, block_size=BLOCK, seed=1)
        before = await coord.refresh_stats()
        results = await asyncio.gather(*[_collect(coord, f"spread-{i}", p, params) for i, p in enumerate(PROMPTS)])
        after = await wait_coordinator_idle(coord)
        return coord.aggregate_stats(), before, after, results

    agg, before, after, results = _run(run())
    assert sum(agg.num_requests_routed) == len(PROMPTS)
    assert all(n > 0 for n in agg.num_requests_routed)  # both engines got requests
    # ... and the engines' own stats show it: both computed prompt tokens for this test.
    assert all(a.num_prompt_tokens > b.num_prompt_tokens for a, b in zip(after, before))
    assert agg.num_free_blocks == agg.num_total_blocks

    offline = LLM(**engine_kwargs)
    expected = offline.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                SamplingParams(**params), use_tqdm=False)
    assert results == [e.outputs[0].token_ids for e in expected]


def test_prefix_affine_requests_land_on_same_engine(engines):
    shared = [(11 * k) % 300 + 20 for k in range(4 * BLOCK)]  # four full blocks
    params = dict(temperature=0, max_tokens=3)

    async def run():
        coord = DPCoordinator(engines, block_size=BLOCK, seed=2)
        before = await coord.refresh_stats()
        for i in range(6):  # sequential: the affinity engine is never much busier than the other
            await _collect(coord, f"affine-{i}", shared + [i + 1, i + 2, i + 3], params)
        after = await wait_coordinator_idle(coord)
        return coord.aggregate_stats(), before, after

    agg, before, after = _run(run())
    routed = agg.num_requests_routed
    assert sorted(routed) == [0, 6]
    target = routed.index(6)
    hits = [a.prefix_cache_hits - b.prefix_cache_hits for a, b in zip(after, before)]
    assert hits[target] >= 5 * 4 * BLOCK - 5  # requests 2..6 reused the shared blocks on that engine
    assert hits[1 - target] == 0


def test_client_disconnect_aborts_and_frees_blocks(engines):
    params = dict(temperature=0, max_tokens=300, ignore_eos=True)

    async def run():
        coord = DPCoordinator(engines, block_size=BLOCK)
        stream = coord.generate("disconnect", PROMPTS[3], params)
        received = 0
        async for _ in stream:
            received += 1
            if received == 3:
                break  # the client goes away mid-stream
        await stream.aclose()
        stats = await wait_coordinator_idle(coord)
        return received, stats, coord.aggregate_stats()

    received, stats, agg = _run(run())
    assert received == 3
    assert agg.num_in_flight == 0
    for s in stats:
        assert s.num_running == 0 and s.num_waiting == 0
        assert s.num_free_blocks == s.num_total_blocks


def test_abort_ends_stream_with_abort_reason(engines):
    params = dict(temperature=0, max_tokens=300, ignore_eos=True)

    async def run():
        coord = DPCoordinator(engines, block_size=BLOCK)
        outputs = []
        async for out in coord.generate("to-abort", PROMPTS[5], params):
            outputs.append(out)
            if len(outputs) == 2:
                await coord.abort("to-abort")
        return outputs, await wait_coordinator_idle(coord)

    outputs, stats = _run(run())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert sum(len(o.outputs[0].token_ids) for o in outputs) < 300
    assert all(s.num_free_blocks == s.num_total_blocks for s in stats)


def test_bad_request_raises_value_error_and_engines_stay_up(engines):
    async def run():
        coord = DPCoordinator(engines, block_size=BLOCK)
        with pytest.raises(ValueError, match="logprobs"):
            await _collect(coord, "bad-params", PROMPTS[0], dict(logprobs=1000))
        with pytest.raises(ValueError, match="prompt"):
            await _collect(coord, "too-long", [5] * 5000, dict(max_tokens=2))
        await coord.refresh_stats()
        return coord.aggregate_stats()

    agg = _run(run())
    assert agg.num_healthy_engines == 2


def test_killed_engine_fails_its_requests_others_complete_and_it_restarts(engines):
    params = dict(temperature=0, max_tokens=120, ignore_eos=True)
    num_requests = 6

    async def run():
        coord = DPCoordinator(engines, block_size=BLOCK, stats_interval_s=0.2, seed=3)
        coord.start()
        routed: dict[str, int] = {}
        started = [asyncio.Event() for _ in range(num_requests)]

        async def one(i: int) -> list[int]:
            tokens: list[int] = []
            async for out in coord.generate(f"kill-{i}", PROMPTS[i], params):
                routed.setdefault(f"kill-{i}", coord._requests[f"kill-{i}"])
                tokens += out.outputs[0].token_ids
                started[i].set()
            return tokens

        tasks = [asyncio.create_task(one(i)) for i in range(num_requests)]
        await asyncio.gather(*[e.wait() for e in started])  # every request is streaming
        ray.kill(engines[0], no_restart=False)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        routed_while_dead = [coord.choose_engine(p) for p in PROMPTS]
        # The actor comes back (Ray restarts it) and the coordinator routes to it again.
        info = await asyncio.to_thread(wait_engines_ready, engines[:1], 180)
        for _ in range(300):
            if coord.engines[0].healthy:
                break
            await asyncio.sleep(0.1)
        healthy_again = coord.engines[0].healthy
        await coord.stop()
        new_tokens = []
        async for ref in engines[0].generate.remote("after-restart", {"prompt_token_ids": PROMPTS[0]},
                                                    dict(temperature=0, max_tokens=4, min_tokens=4)):
            new_tokens += (await ref).outputs[0].token_ids
        return routed, results, routed_while_dead, info, healthy_again, new_tokens

    routed, results, routed_while_dead, info, healthy_again, new_tokens = _run(run(), timeout=300)
    on_killed = [i for i in range(num_requests) if routed[f"kill-{i}"] == 0]
    on_other = [i for i in range(num_requests) if routed[f"kill-{i}"] == 1]
    assert on_killed and on_other
    for i in on_killed:
        assert isinstance(results[i], EngineDeadError), results[i]
        assert "engine 0" in str(results[i])
    for i in on_other:
        assert isinstance(results[i], list) and len(results[i]) == 120
    assert routed_while_dead == [1] * len(PROMPTS)  # routed around the dead engine
    assert info[0]["restarted"] is True and info[0]["engine_index"] == 0
    assert healthy_again
    assert len(new_tokens) == 4


def test_engine_actor_with_tensor_parallel_worker_group(engines, engine_kwargs):
    """An engine actor with TP=2 builds its own Ray worker group; greedy output equals the offline run."""
    tp_engines = start_engine_actors({**engine_kwargs, "tensor_parallel_size": 2}, data_parallel_size=1,
                                     num_cpus_per_engine=0)
    try:
        info = wait_engines_ready(tp_engines, timeout_s=300)[0]
        assert info["tensor_parallel_size"] == 2
        params = dict(temperature=0, max_tokens=6, min_tokens=6)

        async def run():
            coord = DPCoordinator(tp_engines, block_size=BLOCK)
            return await _collect(coord, "tp2", PROMPTS[4], params)

        tokens = _run(run(), timeout=180)
    finally:
        for handle in tp_engines:
            ray.kill(handle, no_restart=True)
    expected = LLM(**engine_kwargs).generate([{"prompt_token_ids": PROMPTS[4]}], SamplingParams(**params),
                                             use_tqdm=False)
    assert tokens == expected[0].outputs[0].token_ids


def test_engine_loop_death_fails_requests_and_triggers_restart(engine_kwargs):
    """In-process (no Ray): when the engine loop dies, its request fails and the watchdog asks for a restart."""

    class RecordingActor(EngineHost):
        died = threading.Event()

        def _on_engine_death(self) -> None:
            self.died.set()

    actor = RecordingActor(engine_kwargs, engine_index=7)

    def broken_step():
        raise RuntimeError("simulated device failure")

    actor.engine.engine.step = broken_step

    async def run():
        async for _ in actor.generate("doomed", {"prompt_token_ids": PROMPTS[0]}, dict(max_tokens=4)):
            pass

    try:
        with pytest.raises(EngineDeadError, match="simulated device failure"):
            _run(run(), timeout=60)
        assert RecordingActor.died.wait(30)
        stats = _run(actor.get_stats())
        assert stats.healthy is False and stats.engine_index == 7
        with pytest.raises(EngineDeadError):
            _run(actor.check_health())
    finally:
        actor.shutdown()


def test_actor_stream_carries_the_prompt_only_in_its_first_output(engine_kwargs):
    """In-process (what `generate` hands to Ray): the prompt is pickled once per stream, not per token."""
    actor = EngineHost(engine_kwargs, engine_index=0)
    params = dict(temperature=0, max_tokens=8, min_tokens=8)

    async def run():
        return [out async for out in actor.generate("once", {"prompt_token_ids": PROMPTS[2]}, params)]

    try:
        outputs = _run(run(), timeout=60)
        sent = _run(actor.get_stats()).num_stream_outputs
    finally:
        actor.shutdown()
    assert len(outputs) > 1 and sent == len(outputs)
    assert outputs[0].prompt_token_ids == PROMPTS[2]
    assert all(out.prompt_token_ids == [] and out.prompt is None for out in outputs[1:])
    expected = LLM(**engine_kwargs).generate([{"prompt_token_ids": PROMPTS[2]}], SamplingParams(**params),
                                             use_tqdm=False)
    assert [t for out in outputs for t in out.outputs[0].token_ids] == expected[0].outputs[0].token_ids


async def _read_stream(handle, request_id: str, prompt: list[int], params: dict, pause_after_first=None):
    """Read an engine actor's stream directly: (text, tokens, number of objects read, prompt ids seen)."""
    text, tokens, count, prompts = "", [], 0, []
    async for ref in handle.generate.remote(request_id, {"prompt_token_ids": prompt}, params):
        out = await ref
        count += 1
        text += out.outputs[0].text
        tokens += out.outputs[0].token_ids
        prompts.append(list(out.prompt_token_ids))
        if count == 1 and pause_after_first is not None:
            await pause_after_first()
    return text, tokens, count, prompts


def test_slow_reader_is_backpressured_and_gets_merged_complete_text(engines):
    """While a reader does not read, the actor stops at a bounded number of unread outputs; what the
    engine makes meanwhile arrives merged, and the text equals a fast reader's greedy text."""
    handle = engines[0]
    params = dict(temperature=0, max_tokens=40, min_tokens=40)
    during: dict[str, int] = {}

    async def wait_until_engine_done(before: int) -> None:
        for _ in range(600):  # the reader sleeps until the engine has generated every token
            stats = await handle.get_stats.remote()
            if stats.num_unfinished == 0:
                break
            await asyncio.sleep(0.05)
        during["sent"] = stats.num_stream_outputs - before

    async def run():
        fast = await _read_stream(handle, "fast-reader", PROMPTS[6], params)
        before = (await handle.get_stats.remote()).num_stream_outputs
        slow = await _read_stream(handle, "slow-reader", PROMPTS[6], params,
                                  pause_after_first=lambda: wait_until_engine_done(before))
        return fast, slow, await wait_coordinator_idle(DPCoordinator(engines, block_size=BLOCK))

    fast, slow, stats = _run(run(), timeout=180)
    assert len(fast[1]) == 40 and fast[:2] == slow[:2]  # same greedy tokens and text
    # 40 steps passed while the reader slept: at most the first, the unread window and one paused yield.
    assert during["sent"] <= STREAM_BACKPRESSURE_OBJECTS + 2
    assert slow[2] <= STREAM_BACKPRESSURE_OBJECTS + 3 < fast[2]  # fewer, larger deltas in all
    assert slow[3][0] == PROMPTS[6] and all(ids == [] for ids in slow[3][1:])
    assert all(s.num_free_blocks == s.num_total_blocks for s in stats)


def test_mass_disconnect_aborts_in_one_rpc_per_engine_and_frees_blocks(engines):
    params = dict(temperature=0, max_tokens=300, ignore_eos=True)

    async def run():
        coord = DPCoordinator(engines, block_size=BLOCK)
        streams = [coord.generate(f"mass-{i}", p, params) for i, p in enumerate(PROMPTS)]
        for stream in streams:
            await stream.__anext__()
        await asyncio.gather(*(stream.aclose() for stream in streams))  # every client leaves at once
        stats = await wait_coordinator_idle(coord)
        return coord._aborts.num_rpcs, stats, coord.aggregate_stats()

    rpcs, stats, agg = _run(run())
    assert rpcs <= len(engines) < len(PROMPTS)
    assert agg.num_in_flight == 0
    for s in stats:
        assert s.num_running == 0 and s.num_waiting == 0
        assert s.num_free_blocks == s.num_total_blocks

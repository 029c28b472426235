"""AsyncLLM: streamed deltas add up to the offline result, aborts free blocks, bad input fails alone."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError, StreamEndedError
from pagedserve.engine.config import EngineConfig


@pytest.fixture(scope="module")
def async_llm(tiny_llama):
    engine = AsyncLLM(EngineConfig(model=str(tiny_llama), dtype="float32", block_size=4, kv_cache_memory="8MiB"),
                      max_pending_requests=64)
    yield engine
    engine.shutdown()


async def _collect(engine: AsyncLLM, prompt, params, **kw):
    text, tokens, finals = "", [], []
    async for out in engine.generate(prompt, params, **kw):
        text += out.outputs[0].text
        tokens += out.outputs[0].token_ids
        if out.outputs[0].finish_reason is not None:
            finals.append(out.outputs[0].finish_reason)
    return text, tokens, finals


def _wait_idle(engine: AsyncLLM):
    async def wait():
        for _ in range(200):
            stats = engine.get_stats()
            if stats.num_unfinished == 0 and stats.scheduler.num_running == 0:
                break
            await asyncio.sleep(0.05)
        return engine.get_stats()
    return wait()


def test_streamed_deltas_equal_offline_output(async_llm, tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    prompts = ["def fibonacci(n):", "The quick brown fox", "import os"]

    async def run():
        return await asyncio.gather(*[_collect(async_llm, p, params) for p in prompts])

    results = asyncio.run(run())
    offline = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory="8MiB")
    expected = offline.generate(prompts, params, use_tqdm=False)
    for (text, tokens, finals), exp in zip(results, expected):
        assert tokens == exp.outputs[0].token_ids
        assert text == exp.outputs[0].text
        assert finals == ["length"]  # exactly one output carries the finish reason


def test_slow_consumer_gets_merged_deltas_that_add_up(async_llm, tiny_llama):
    """A consumer that falls behind receives several steps' deltas as one output: fewer outputs, same
    text, tokens and logprobs, and one finish reason, for each of n=2 completions."""
    params = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=24, min_tokens=24, logprobs=2)

    async def run(slow: bool):
        pieces: dict[int, list] = {0: ["", [], [], []], 1: ["", [], [], []]}
        count = 0
        async for out in async_llm.generate("def fibonacci(n):", params):
            count += 1
            for c in out.outputs:
                acc = pieces[c.index]
                acc[0] += c.text
                acc[1] += c.token_ids
                acc[2] += c.logprobs or []
                if c.finish_reason is not None:
                    acc[3].append(c.finish_reason)
            if slow:
                await asyncio.sleep(0.05)  # several engine steps pass meanwhile
        return pieces, count

    fast, fast_count = asyncio.run(run(slow=False))
    slow, slow_count = asyncio.run(run(slow=True))
    assert slow_count < fast_count
    for index in (0, 1):
        assert slow[index][:2] == fast[index][:2]
        assert len(slow[index][2]) == len(slow[index][1]) == 24
        for token, slow_pos, fast_pos in zip(slow[index][1], slow[index][2], fast[index][2]):
            assert token in slow_pos and slow_pos.keys() == fast_pos.keys()
            assert slow_pos[token].logprob == pytest.approx(fast_pos[token].logprob, abs=1e-5)
        assert slow[index][3] == ["length"]


def test_abort_on_disconnect_frees_blocks(async_llm):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def run():
        count = 0
        async for _ in async_llm.generate("hello", params, request_id="to-abort"):
            count += 1
            if count == 3:
                break  # the client goes away
        return await _wait_idle(async_llm)

    stats = asyncio.run(run())
    assert stats.num_unfinished == 0
    assert stats.scheduler.num_free_blocks == stats.scheduler.num_total_blocks


def test_bad_request_fails_alone(async_llm):
    good = SamplingParams(temperature=0, max_tokens=5, min_tokens=5)

    async def run():
        ok = asyncio.create_task(_collect(async_llm, "hello", good))
        with pytest.raises(ValueError, match="logprobs"):
            await _collect(async_llm, "hello", SamplingParams(logprobs=1000))
        with pytest.raises(ValueError, match="prompt"):
            await _collect(async_llm, {"prompt_token_ids": [5] * 5000}, good)
        return await ok

    _, tokens, finals = asyncio.run(run())
    assert len(tokens) == 5 and finals == ["length"]
    assert async_llm.is_healthy()


def test_overload_is_rejected(tiny_llama):
    engine = AsyncLLM(EngineConfig(model=str(tiny_llama), dtype="float32", kv_cache_memory="8MiB"),
                      max_pending_requests=2)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)  # runs to max_model_len

    async def run():
        streams = [engine.generate("a", params), engine.generate("b", params)]
        firsts = [await s.__anext__() for s in streams]
        with pytest.raises(EngineOverloadedError):
            await engine.generate("c", params).__anext__()
        for s in streams:
            await s.aclose()
        return firsts

    try:
        assert len(asyncio.run(run())) == 2
    finally:
        engine.shutdown()


def test_batched_abort_reaches_the_engine_as_one_call_and_frees_blocks(async_llm):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    calls: list[list[str]] = []
    engine = async_llm.engine
    original = engine.abort_request

    def recording(request_ids):
        calls.append(list(request_ids))
        original(request_ids)

    async def run():
        streams = [async_llm.generate(f"word {i}", params, request_id=f"batch-{i}") for i in range(6)]
        for stream in streams:
            await stream.__anext__()
        await async_llm.abort_requests([f"batch-{i}" for i in range(6)])
        for _ in range(100):
            stats = async_llm.get_stats()
            if stats.num_unfinished == 0 and stats.scheduler.num_running == 0:
                break
            await asyncio.sleep(0.05)
        # Their consumers never get another output (the actor ends its streams itself): close them.
        for stream in streams:
            await stream.aclose()
        return async_llm.get_stats()

    engine.abort_request = recording
    try:
        stats = asyncio.run(run())
    finally:
        engine.abort_request = original
    assert calls[0] == [f"batch-{i}" for i in range(6)]  # one engine call for the six
    assert stats.num_unfinished == 0
    assert stats.scheduler.num_free_blocks == stats.scheduler.num_total_blocks


def test_failed_executor_stops_the_engine_so_it_can_be_restarted(tiny_llama):
    """A step whose workers are gone fails its batch; after that the executor can do nothing more, so
    the loop stops: waiting requests fail with EngineDeadError and the engine reports itself dead."""
    engine = AsyncLLM(EngineConfig(model=str(tiny_llama), dtype="float32", kv_cache_memory="8MiB"))
    executor = engine.engine.engine_core.executor
    workers_gone = threading.Event()
    executor.__class__ = type("LosingExecutor", (type(executor),),
                              {"is_failed": property(lambda self: workers_gone.is_set())})
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def run():
        stream = engine.generate("hello", params)
        await stream.__anext__()
        workers_gone.set()
        with pytest.raises(EngineDeadError, match="executor failed"):
            async for _ in stream:
                pass

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
        stats = engine.get_stats()
        assert not stats.engine_alive and not stats.healthy
    finally:
        engine.shutdown()


def test_a_refused_duplicate_request_id_leaves_the_running_request_alone(async_llm):
    """A second generate() under a running request's id is refused (ValueError), and that refusal never
    aborts the first request, which finishes with every token."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def slow_steps(stage: str, request_id: str) -> None:  # the first request outlives the refused one
        if stage == "sample" and request_id == "dup":
            time.sleep(0.02)

    async def run():
        tokens, finals = [], []
        first = async_llm.generate("def fibonacci(n):", params, request_id="dup")
        out = await anext(first)  # the first request is running now
        tokens += out.outputs[0].token_ids
        with pytest.raises(ValueError, match="already in use"):
            await _collect(async_llm, "import os", params, request_id="dup")

        async def rest():
            async for out in first:
                tokens.extend(out.outputs[0].token_ids)
                finals.extend([out.outputs[0].finish_reason] if out.outputs[0].finish_reason else [])

        await asyncio.wait_for(rest(), 120)  # an aborted first request would never finish here
        return tokens, finals

    async_llm.engine.engine_core.executor.collective_rpc("set_fault_injector", (slow_steps,))
    try:
        tokens, finals = asyncio.run(run())
    finally:
        async_llm.engine.engine_core.executor.collective_rpc("set_fault_injector", (None,))
    assert len(tokens) == 24 and finals == ["length"]


def test_a_caller_that_leaves_while_its_request_is_being_added_leaves_nothing_running(async_llm):
    """Cancelled at every point around the add: the engine stays alive and every block is free again."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    async def leave_early(delay_turns: int):
        agen = async_llm.generate("The quick brown fox", params)
        task = asyncio.ensure_future(anext(agen))
        for _ in range(delay_turns):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await agen.aclose()

    async def run():
        for turns in range(6):
            await leave_early(turns)
        # The engine still serves, and nothing of the cancelled calls keeps running.
        _, tokens, _ = await _collect(async_llm, "import os", params)
        for _ in range(200):
            stats = async_llm.get_stats()
            if stats.num_unfinished == 0:
                break
            await asyncio.sleep(0.02)
        return tokens, stats

    tokens, stats = asyncio.run(run())
    assert len(tokens) == 16
    assert stats.healthy and stats.num_unfinished == 0
    assert stats.scheduler.num_free_blocks == stats.scheduler.num_total_blocks


def test_the_engine_is_built_and_stepped_on_its_own_thread(tiny_llama, monkeypatch):
    """Every forward of the engine (the warm-up while building it, then the steps) runs on the engine
    thread: OpenMP keeps a thread pool per thread that opens parallel regions, and a second pool left by
    building on the caller's thread made libgomp stop spinning between regions (0.74x the offline speed)."""
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.engine.worker.model_runner import ModelRunner

    seen: set[int] = set()
    execute = ModelRunner.execute_model

    def recording(self, *args, **kwargs):
        seen.add(threading.get_ident())
        return execute(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "execute_model", recording)
    init = LLMEngine.__init__

    def recording_init(self, *args, **kwargs):
        seen.add(threading.get_ident())
        init(self, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "__init__", recording_init)
    engine = AsyncLLM(EngineConfig(model=str(tiny_llama), dtype="float32", block_size=4, kv_cache_memory="8MiB"))
    try:
        asyncio.run(_collect(engine, "def fibonacci(n):", SamplingParams(temperature=0, max_tokens=4)))
        assert seen == {engine._thread.ident}
        assert threading.get_ident() not in seen
    finally:
        engine.shutdown()


def test_what_building_the_engine_raises_is_raised_in_the_caller(tiny_llama):
    config = EngineConfig(model=str(tiny_llama), dtype="float32", block_size=4, kv_cache_memory="1KiB")
    with pytest.raises(ValueError, match="kv_cache_memory"):
        AsyncLLM(config)


def test_a_steps_outputs_reach_the_event_loop_in_one_hand_over(async_llm, tiny_llama, monkeypatch):
    """Concurrent streams' outputs of one engine step go to their event loop in one call (one wake-up of
    the loop, not one per request), each stream's outputs in order and complete."""
    import pagedserve.engine.output_streams as output_streams_module

    hand_overs: list[list[str]] = []
    original = output_streams_module._put_all

    def recording(items):
        hand_overs.append([item.request_id for _, item in items if not isinstance(item, BaseException)])
        original(items)

    monkeypatch.setattr(output_streams_module, "_put_all", recording)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [f"item {i} of the list" for i in range(6)]

    async def run():
        return await asyncio.gather(*[_collect(async_llm, p, params, request_id=f"hand-{i}")
                                      for i, p in enumerate(prompts)])

    results = asyncio.run(run())
    expected = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory="8MiB").generate(
        prompts, params, use_tqdm=False)
    for (_, tokens, finals), exp in zip(results, expected):
        assert tokens == exp.outputs[0].token_ids and finals == ["length"]
    ours = [ids for ids in hand_overs if any(i.startswith("hand-") for i in ids)]
    assert sum(len(ids) for ids in ours) == 6 * 16  # every delta, each in exactly one hand-over
    assert max(len(set(ids)) for ids in ours) == 6  # steps where all six decoded went out together
    assert len(ours) < 6 * 16 / 2


def test_end_streams_ends_a_running_stream_after_its_outputs_and_frees_blocks(async_llm):
    """`end_streams` aborts the request and ends its stream with StreamEndedError once the outputs already
    on their way are read: a serving layer answers an abort on the stream itself, nothing races it."""
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

    async def run():
        tokens = []
        with pytest.raises(StreamEndedError, match="end-me"):
            async for out in async_llm.generate("hello", params, request_id="end-me"):
                tokens += out.outputs[0].token_ids
                assert out.outputs[0].finish_reason is None
                if len(tokens) >= 3:
                    async_llm.end_streams(["end-me", "no-such-request"])
        return tokens, await _wait_idle(async_llm)

    tokens, stats = asyncio.run(run())
    assert 3 <= len(tokens) < 300
    assert stats.num_unfinished == 0
    assert stats.scheduler.num_free_blocks == stats.scheduler.num_total_blocks


def test_end_streams_before_the_request_is_added_never_runs_it(async_llm, monkeypatch):
    """A stream ended while its call is still preparing the request (tokenizing bad words, off the loop)
    raises at once and its request never reaches the engine."""
    added = []
    original = async_llm.engine.add_request
    monkeypatch.setattr(async_llm.engine, "add_request", lambda rid, *a, **k: (added.append(rid), original(rid, *a, **k)))
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, bad_words=["zzz"])

    async def run():
        stream = async_llm.generate("hello", params, request_id="ended-early")
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # the call is now awaiting its bad-words tokenization
        async_llm.end_streams(["ended-early"])
        with pytest.raises(StreamEndedError):
            await first
        return await _wait_idle(async_llm)

    stats = asyncio.run(run())
    assert "ended-early" not in added
    assert stats.num_unfinished == 0 and stats.scheduler.num_free_blocks == stats.scheduler.num_total_blocks


def test_end_streams_leaves_a_running_request_of_the_same_id_to_its_own_caller(async_llm):
    """A second call with a running request's id is refused; it never takes over the first stream, which
    `end_streams` still ends."""
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

    async def run():
        first = async_llm.generate("hello", params, request_id="dup-end")
        await anext(first)
        with pytest.raises(ValueError):
            async for _ in async_llm.generate("hello", params, request_id="dup-end"):
                pass
        async_llm.end_streams(["dup-end"])
        with pytest.raises(StreamEndedError):
            async for _ in first:
                pass
        return await _wait_idle(async_llm)

    stats = asyncio.run(run())
    assert stats.num_unfinished == 0 and stats.scheduler.num_free_blocks == stats.scheduler.num_total_blocks


def test_end_streams_from_another_thread_ends_the_stream_on_its_own_loop(async_llm):
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

    async def run():
        count = 0
        with pytest.raises(StreamEndedError):
            async for _ in async_llm.generate("hello", params, request_id="end-from-thread"):
                count += 1
                if count == 2:
                    await asyncio.to_thread(async_llm.end_streams, ["end-from-thread"])
        return await _wait_idle(async_llm)

    stats = asyncio.run(run())
    assert stats.num_unfinished == 0 and stats.scheduler.num_free_blocks == stats.scheduler.num_total_blocks

"""Stream coalescing (`--stream-interval`): a streamed request's deltas merged to one per N generated tokens.

The merge itself (`DeltaCoalescer`) on hand-made outputs: when it sends, and that what it sends adds up
to what interval 1 sends (text, token ids, logprobs, finish and stop reason, n > 1, errors). Then
`AsyncLLM(stream_interval=4)` against `AsyncLLM(stream_interval=1)` on the same tiny model: fewer
outputs, the same concatenation (greedy with logprobs, n=2 seeded sampling, a stop string), and every
KV block free afterwards. The served path (`pagedserve serve --stream-interval 4`) is
tests/test_stream_interval_serve.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedserve.cluster.settings import ServeArgs
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.delta_coalescer import AUTO_MAX_INTERVAL, AUTO_STREAMS_PER_STEP, DeltaCoalescer, auto_interval
from pagedserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.engine.sampling_params import SamplingParams

# --------------------------------------------------------------------------- the merge


def _delta(tokens: list[int], index: int = 0, finish: str | None = None, stop=None, finished: bool | None = None,
           error: str | None = None, prompt_logprobs=None) -> RequestOutput:
    """One step's DELTA output: token t has text "<t>" and logprob -t/10."""
    logprobs = [{t: Logprob(-t / 10, 1, f"<{t}>")} for t in tokens]
    completion = CompletionOutput(index, "".join(f"<{t}>" for t in tokens), list(tokens), -sum(tokens) / 10,
                                  logprobs, finish, stop)
    done = finish is not None if finished is None else finished
    return RequestOutput("r", "p", [1, 2], prompt_logprobs, [completion], done, error=error)


def _feed(coalescer: DeltaCoalescer, outputs: list[RequestOutput]) -> list[RequestOutput]:
    return [sent for output in outputs if (sent := coalescer.push(output)) is not None]


def _joined(outputs: list[RequestOutput]) -> dict[int, dict]:
    """What a client concatenating the chunks has, per completion index."""
    choices: dict[int, dict] = {}
    for output in outputs:
        for c in output.outputs:
            got = choices.setdefault(c.index, {"text": "", "tokens": [], "logprobs": [], "finish": [], "stop": None})
            got["text"] += c.text
            got["tokens"] += c.token_ids
            got["logprobs"] += c.logprobs or []
            if c.finish_reason is not None:
                got["finish"].append(c.finish_reason)
                got["stop"] = c.stop_reason
    return choices


def _steps(count: int, index: int = 0, finish: str = "length", stop=None) -> list[RequestOutput]:
    outputs = [_delta([100 * index + t + 1], index) for t in range(count - 1)]
    return outputs + [_delta([100 * index + count], index, finish, stop)]


def test_interval_one_sends_every_output_as_it_is():
    coalescer = DeltaCoalescer(1)
    outputs = _steps(5)
    assert [coalescer.push(o) for o in outputs] == outputs


def test_the_first_token_goes_at_once_then_one_output_per_interval_and_the_finish_at_once():
    coalescer = DeltaCoalescer(4)
    outputs = _steps(10, stop="</s>")
    sent_at = [i for i, o in enumerate(outputs) if coalescer.push(o) is not None]
    assert sent_at == [0, 4, 8, 9]  # token 1 alone; tokens 2-5; 6-9; the finish (token 10) at once
    sent = _feed(DeltaCoalescer(4), _steps(10, stop="</s>"))
    assert [len(o.outputs[0].token_ids) for o in sent] == [1, 4, 4, 1]
    assert _joined(sent) == _joined(_steps(10, stop="</s>"))  # text, tokens, logprobs in order; one finish
    assert _joined(sent)[0]["finish"] == ["length"] and _joined(sent)[0]["stop"] == "</s>"
    assert [o.finished for o in sent] == [False, False, False, True]
    last = _steps(10)[-1].outputs[0].cumulative_logprob
    assert sent[-1].outputs[0].cumulative_logprob == last  # the last step's (a running figure), not a sum


def test_a_step_of_several_tokens_counts_them_all():
    """Speculative decoding (or a continued request) delivers several tokens in one step."""
    sent = _feed(DeltaCoalescer(4), [_delta([1]), _delta([2, 3]), _delta([4, 5, 6]), _delta([7]),
                                     _delta([8], finish="stop", stop=50)])
    assert [o.outputs[0].token_ids for o in sent] == [[1], [2, 3, 4, 5, 6], [7, 8]]
    assert _joined(sent)[0]["stop"] == 50


def test_n_completions_are_counted_apart_and_each_starts_and_finishes_at_once():
    """n=2: the children's deltas interleave; each child's first token goes at once, each one's finish too."""
    a, b = _steps(6, index=0), _steps(6, index=1)
    interleaved = [x for pair in zip(a, b) for x in pair]
    for o in interleaved[:-1]:
        o.finished = False  # the request finishes with its last child
    want = _joined(interleaved)  # (before the merge, which extends the outputs it holds)
    sent = _feed(DeltaCoalescer(3), interleaved)
    joined = _joined(sent)
    assert joined == want
    assert joined[0]["finish"] == joined[1]["finish"] == ["length"]
    # Each child on its own: its first token alone, then its tokens 2-4 and 5-6 (with its finish) as
    # they come due; the other child's held tokens wait for their own turn.
    per_child = [[(c.index, c.token_ids) for c in o.outputs] for o in sent]
    assert per_child == [[(0, [1])], [(1, [101])], [(0, [2, 3, 4])], [(1, [102, 103, 104])],
                         [(0, [5, 6])], [(1, [105, 106])]]
    assert sent[-1].finished and not any(o.finished for o in sent[:-1])


def test_an_engine_error_goes_at_once_with_what_was_held():
    coalescer = DeltaCoalescer(8)
    assert coalescer.push(_delta([1])) is not None
    assert coalescer.push(_delta([2])) is None
    failed = coalescer.push(_delta([], finish="error", error="the step failed"))
    assert failed is not None and failed.error == "the step failed" and failed.outputs[0].token_ids == [2]


def test_flush_hands_over_what_is_held_once():
    coalescer = DeltaCoalescer(8)
    coalescer.push(_delta([1], prompt_logprobs=[None, {2: Logprob(-0.5, 1, "b")}]))
    assert coalescer.push(_delta([2])) is None and coalescer.push(_delta([3])) is None
    held = coalescer.flush()
    assert held is not None and held.outputs[0].token_ids == [2, 3] and held.outputs[0].text == "<2><3>"
    assert coalescer.flush() is None
    # after a flush the count starts again; the first token was already sent
    assert coalescer.push(_delta([4])) is None


def test_prompt_logprobs_ride_in_the_first_output():
    sent = _feed(DeltaCoalescer(4), [_delta([1], prompt_logprobs=[None, {2: Logprob(-0.5, 1, "b")}]),
                                     *_steps(6)[1:]])
    assert sent[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in sent[1:])


def test_the_interval_is_checked_where_it_is_set(tiny_llama):
    with pytest.raises(ValueError, match="stream_interval"):
        DeltaCoalescer(0)
    with pytest.raises(ValueError, match="stream_interval"):
        ServeArgs(model=str(tiny_llama), stream_interval=0)
    assert ServeArgs(model=str(tiny_llama), stream_interval=4).stream_interval == 4


def test_the_flag_reaches_serve_args_and_the_engine_replicas(tiny_llama):
    from pagedserve.cluster.cli import build_parser, serve_args_from
    from pagedserve.cluster.serve.pd_app import pool_specs

    ns = build_parser().parse_args(["serve", str(tiny_llama), "--stream-interval", "8"])
    args = serve_args_from(ns)
    assert args.stream_interval == 8 and args.to_dict()["stream_interval"] == 8  # what build_app receives
    assert serve_args_from(build_parser().parse_args(["serve", str(tiny_llama)])).stream_interval == "auto"
    assert "stream_interval" not in args.engine_kwargs()  # a serving setting, not the engine's
    pd = ServeArgs(model=str(tiny_llama), stream_interval=8, num_prefill_engines=1, num_decode_engines=1)
    assert {spec.stream_interval for spec in pool_specs(pd).values()} == {8}


# --------------------------------------------------------------------------- AsyncLLM


@pytest.fixture(scope="module")
def engines(tiny_llama):
    config = dict(model=str(tiny_llama), dtype="float32", block_size=4, kv_cache_memory="8MiB")
    made = {interval: AsyncLLM(EngineConfig(**config), stream_interval=interval) for interval in (1, 4)}
    yield made
    for engine in made.values():
        engine.shutdown()


def _stream(engine: AsyncLLM, prompt: str, params: SamplingParams) -> tuple[int, dict[int, dict]]:
    async def run() -> list[RequestOutput]:
        return [output async for output in engine.generate(prompt, params)]

    outputs = asyncio.run(run())
    return len(outputs), _joined(outputs)


def _assert_same(got: dict[int, dict], want: dict[int, dict]) -> None:
    assert got.keys() == want.keys()
    for index, w in want.items():
        g = got[index]
        assert (g["text"], g["tokens"], g["finish"], g["stop"]) == (w["text"], w["tokens"], w["finish"], w["stop"])
        assert len(g["logprobs"]) == len(w["logprobs"])
        for token, gp, wp in zip(g["tokens"], g["logprobs"], w["logprobs"]):
            assert token in gp and gp.keys() == wp.keys()
            assert gp[token].logprob == pytest.approx(wp[token].logprob, abs=1e-5)
            assert gp[token].decoded_token == wp[token].decoded_token


def _assert_all_blocks_free(engine: AsyncLLM) -> None:
    """Every KV block is free again (the stats trail the last step: a bounded wait)."""
    for _ in range(200):
        stats = engine.get_stats()
        if stats.num_unfinished == 0 and stats.scheduler.num_running == 0:
            break
        time.sleep(0.05)
    assert stats.scheduler.num_free_blocks == stats.scheduler.num_total_blocks


def test_async_llm_streams_fewer_outputs_that_add_up_to_the_same(engines):
    greedy = SamplingParams(temperature=0, max_tokens=21, min_tokens=21, logprobs=2)
    n_sampled = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=13, min_tokens=13, logprobs=1)
    for params in (greedy, n_sampled):
        _, want = _stream(engines[1], "def fibonacci(n):", params)
        count, got = _stream(engines[4], "def fibonacci(n):", params)
        _assert_same(got, want)
        # Per completion: its first token alone, then one delta per 4 tokens, the finish with the last
        # ones (interval 1 sends one per token and step, fewer only when its reader falls behind).
        n, tokens = params.n, params.max_tokens
        assert count <= n * (1 + -(-(tokens - 1) // 4)) < n * tokens


def test_async_llm_stop_strings_end_the_coalesced_text_where_interval_one_ends_it(engines):
    free = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    _, whole = _stream(engines[1], "The quick brown fox", free)
    text = whole[0]["text"]
    stop = next(text[i: i + 3] for i in range(len(text) // 2, len(text) - 3) if not any(ch.isspace() for ch in text[i: i + 3]))
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    _, want = _stream(engines[1], "The quick brown fox", params)
    _, got = _stream(engines[4], "The quick brown fox", params)
    _assert_same(got, want)
    assert got[0]["finish"] == ["stop"] and got[0]["stop"] == stop and stop not in got[0]["text"]
    for engine in engines.values():
        _assert_all_blocks_free(engine)


def test_async_llm_refuses_a_bad_interval(tiny_llama):
    with pytest.raises(ValueError, match="stream_interval"):
        AsyncLLM(EngineConfig(model=str(tiny_llama), dtype="float32", kv_cache_memory="8MiB"), stream_interval=0)


def test_a_stream_that_ends_with_an_error_gets_what_was_held_first(tiny_llama):
    """The engine stops (a replica drained) mid-stream: the tokens held for the interval arrive before the
    `EngineStoppedError`, so that a migration continues from everything the engine generated."""
    from pagedserve.engine.async_llm import EngineStoppedError

    engine = AsyncLLM(EngineConfig(model=str(tiny_llama), dtype="float32", kv_cache_memory="8MiB"),
                      stream_interval=1000)
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def run() -> list[int]:
        received: list[int] = []
        with pytest.raises(EngineStoppedError):
            async for output in engine.generate("def fibonacci(n):", params, request_id="drained"):
                received += output.outputs[0].token_ids
                if len(received) == 1:  # the first token came at once; the rest is held (interval 1000)
                    state = engine.engine.output_processor.states["drained"]
                    for _ in range(2000):  # the engine steps on meanwhile (a bounded wait: not to its end)
                        if len(state.token_ids) > 3:
                            break
                        await asyncio.sleep(0.001)
                    await asyncio.to_thread(engine.shutdown)
        return received

    received = asyncio.run(run())
    generated = engine.engine.output_processor.states["drained"].token_ids
    assert len(generated) > 1 and received == generated


# --------------------------------------------------------------------------- "auto"


def test_auto_interval_is_one_for_few_streams_and_grows_with_them_up_to_its_cap():
    assert [auto_interval(n) for n in (0, 1, AUTO_STREAMS_PER_STEP)] == [1, 1, 1]
    assert auto_interval(AUTO_STREAMS_PER_STEP + 1) == 2
    assert auto_interval(4 * AUTO_STREAMS_PER_STEP) == 4
    assert auto_interval(1000 * AUTO_STREAMS_PER_STEP) == AUTO_MAX_INTERVAL


def test_a_push_may_name_its_own_interval():
    coalescer = DeltaCoalescer(1)
    outputs = _steps(10)
    sent_at = [i for i, o in enumerate(outputs) if coalescer.push(o, interval=3) is not None]
    assert sent_at == [0, 3, 6, 9]  # token 1 alone; 2-4; 5-7; 8-10 with the finish


def test_auto_is_accepted_where_the_interval_is_set_and_nothing_else_is(tiny_llama):
    from pagedserve.cluster.cli import build_parser, serve_args_from

    assert ServeArgs(model=str(tiny_llama), stream_interval="auto").stream_interval == "auto"
    for bad in ("fast", 0, -1, 1.5):
        with pytest.raises(ValueError, match="stream_interval"):
            ServeArgs(model=str(tiny_llama), stream_interval=bad)
    ns = build_parser().parse_args(["serve", str(tiny_llama), "--stream-interval", "auto"])
    assert serve_args_from(ns).to_dict()["stream_interval"] == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", str(tiny_llama), "--stream-interval", "often"])
    for bad in ("fast", 0, True):
        with pytest.raises(ValueError, match="stream_interval"):
            AsyncLLM(EngineConfig(model=str(tiny_llama), dtype="float32", kv_cache_memory="8MiB"), stream_interval=bad)


def test_auto_streams_every_token_to_a_few_requests_and_merges_them_for_many(tiny_llama, monkeypatch):
    """`stream_interval="auto"`: a lone stream runs at interval 1; with four times the per-step budget of
    streams open, at 4 (about one output per four tokens); either way the outputs add up to exactly what
    interval 1 streams, and every KV block is free afterwards."""
    intervals: list[int | None] = []
    push = DeltaCoalescer.push
    monkeypatch.setattr(DeltaCoalescer, "push", lambda self, output, interval=None: (
        intervals.append(interval), push(self, output, interval))[1])
    config = dict(model=str(tiny_llama), dtype="float32", block_size=4, kv_cache_memory="16MiB", max_num_seqs=128)
    auto = AsyncLLM(EngineConfig(**config), stream_interval="auto")
    plain = AsyncLLM(EngineConfig(**config), stream_interval=1)
    tokens = 24
    params = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True)

    async def streams(engine: AsyncLLM, count: int) -> list[list[RequestOutput]]:
        async def one(i: int) -> list[RequestOutput]:
            return [o async for o in engine.generate({"prompt_token_ids": [5 + i % 7, 6, 7, 8]}, params)]
        return await asyncio.gather(*(one(i) for i in range(count)))

    try:
        alone = asyncio.run(streams(auto, 1))[0]
        assert set(intervals) == {1} and len(intervals) == tokens  # (a reader that lags may still merge)
        assert sum(len(o.outputs[0].token_ids) for o in alone) == tokens
        intervals.clear()
        many = 4 * AUTO_STREAMS_PER_STEP
        got, want = asyncio.run(streams(auto, many)), asyncio.run(streams(plain, many))
        for g, w in zip(got, want):
            _assert_same(_joined(g), _joined(w))
        # The streams are open together once every request is added (before that, fewer: smaller intervals).
        assert max(i for i in intervals if i is not None) == 4 and None not in intervals
        counts = sorted(len(g) for g in got)
        assert counts[len(counts) // 2] <= 1 + -(-(tokens - 1) // 3) < tokens
        for engine in (auto, plain):
            _assert_all_blocks_free(engine)
        assert auto._outputs.num_coalesced == 0  # every stream it counted was forgotten again
    finally:
        auto.shutdown()
        plain.shutdown()

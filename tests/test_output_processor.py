"""OutputProcessor: stop strings end a request only once it has min_tokens tokens (as EOS and stop
token ids do), with and without the stop string in the output, and win over a length limit hit on
the same token."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pagedserve.engine.output_processor import OutputKind, OutputProcessor
from pagedserve.engine.outputs import EngineCoreOutput
from pagedserve.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def feed(processor: OutputProcessor, rid: str, tokens: list[int], last_finish: str | None = None):
    """One token per step, as the engine core emits them; returns (outputs, step that was stopped by a string)."""
    outputs, stopped_at = [], None
    for step, token in enumerate(tokens):
        finish = last_finish if step == len(tokens) - 1 else None
        outs, stopped = processor.process_outputs([EngineCoreOutput(rid, [token], finish_reason=finish)])
        outputs += outs
        if stopped:
            assert stopped == [rid] and stopped_at is None
            stopped_at = step
        if outs and outs[-1].finished:
            break
    return outputs, stopped_at


@pytest.mark.parametrize("include", [False, True])
def test_min_tokens_holds_stop_strings_back(tokenizer, include):
    newline = tokenizer.encode("\n", add_special_tokens=False)
    fox = tokenizer.encode(" fox", add_special_tokens=False)
    assert len(newline) == 1 and len(fox) == 1
    tokens = newline + fox * 8 + newline + fox * 5  # newlines at output tokens 1 and 10
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=20, min_tokens=10, stop=["\n"], include_stop_str_in_output=include)
    processor.add_request("r", None, [5, 6, 7], params, arrival_time=0.0, output_kind=OutputKind.FINAL_ONLY)
    outputs, stopped_at = feed(processor, "r", tokens)
    assert stopped_at == 9  # the 10th token, not the first newline
    (final,) = outputs
    completion = final.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == "\n"
    assert completion.token_ids == tokens[:10]
    assert completion.text == "\n" + " fox" * 8 + ("\n" if include else "")
    assert not processor.has_unfinished_requests()


def test_stop_string_on_the_last_allowed_token_reports_stop(tokenizer):
    newline = tokenizer.encode("\n", add_special_tokens=False)
    fox = tokenizer.encode(" fox", add_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=3, stop=["\n"])
    processor.add_request("r", None, [5, 6, 7], params, arrival_time=0.0)
    # The engine finishes the request with "length" on the very token that completes the stop string.
    outputs, stopped_at = feed(processor, "r", fox * 2 + newline, last_finish="length")
    assert stopped_at is None  # already finished by the engine: nothing more to stop
    completion = outputs[-1].outputs[0]
    assert (completion.finish_reason, completion.stop_reason, completion.text) == ("stop", "\n", " fox fox")


@pytest.mark.parametrize("stop", [None, ["\n"]])
def test_checkpoint_outputs_are_deltas_per_interval_that_join_to_the_final_only_answer(tokenizer, monkeypatch, stop):
    """CHECKPOINT: nothing before the interval is up, then one delta of every token since the last one,
    and the finished delta; the text is decoded once into the finishing delta (incrementally only with
    stop strings); joined, the deltas equal the FINAL_ONLY output of the same tokens."""
    from pagedserve.engine import output_processor

    fox = tokenizer.encode(" fox", add_special_tokens=False)
    jumps = tokenizer.encode(" jumps", add_special_tokens=False)
    tokens = (fox + jumps) * 5
    clock = [1000.0]
    monkeypatch.setattr(output_processor.time, "time", lambda: clock[0])
    params = SamplingParams(max_tokens=len(tokens), stop=stop, logprobs=1 if stop is None else None)
    answers = {}
    for kind in (OutputKind.CHECKPOINT, OutputKind.FINAL_ONLY):
        processor = OutputProcessor(tokenizer)
        processor.add_request("r", None, [5, 6, 7], params, arrival_time=0.0, output_kind=kind,
                              checkpoint_interval_s=3.0)
        outputs = []
        for step, token in enumerate(tokens):
            clock[0] += 1.0  # three steps per interval
            finish = "length" if step == len(tokens) - 1 else None
            logprobs = [[(token, -0.5, 1)]] if params.logprobs is not None else None
            outs, _ = processor.process_outputs([EngineCoreOutput("r", [token], finish_reason=finish,
                                                                  new_logprobs=logprobs)])
            outputs += outs
        answers[kind] = outputs
        assert not processor.has_unfinished_requests()
    checkpoints, (final,) = answers[OutputKind.CHECKPOINT], answers[OutputKind.FINAL_ONLY]
    assert [sum(len(o.outputs[0].token_ids) for o in checkpoints[: i + 1]) for i in range(len(checkpoints))] == \
        [3, 6, 9, 10]
    assert [o.finished for o in checkpoints] == [False, False, False, True]
    joined = [t for o in checkpoints for t in o.outputs[0].token_ids]
    assert joined == final.outputs[0].token_ids == tokens
    assert "".join(o.outputs[0].text for o in checkpoints) == final.outputs[0].text == tokenizer.decode(tokens)
    if stop is None:
        assert all(o.outputs[0].text == "" for o in checkpoints[:-1])  # decoded once, at the end
        assert [lp for o in checkpoints for lp in o.outputs[0].logprobs] == final.outputs[0].logprobs

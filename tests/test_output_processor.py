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

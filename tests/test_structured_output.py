"""Structured output in the engine: every constrained output is in its language (greedy, sampled,
n > 1, seeded, under preemption and chunked prefill), unconstrained neighbours are untouched, bad
specs are ValueErrors naming the field, and a grammar that fails to compile fails its request alone.
Random-weight models produce noise without the mask, so validity here is the mask's doing."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.structured_output import StructuredOutputsParams
from tests.grammar_faults import faulty_compile
from tests.structured_output_checks import SPECS, assert_valid_outputs, constrained, is_valid
from tests.test_engine_parity import assert_all_blocks_free, random_prompts

KINDS = list(SPECS)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=256, max_model_len=256)
    yield llm
    llm.shutdown()


def _prompts(seed: int, n: int) -> list[dict]:
    return [{"prompt_token_ids": p} for p in random_prompts(seed, [5 + 3 * i for i in range(n)])]


@pytest.mark.parametrize("kind", KINDS)
def test_every_output_is_valid_greedy_sampled_and_n3(llm, kind):
    prompts = _prompts(1, 4)
    # Any object may nest without end on random weights: those mostly run to max_tokens.
    limit = 16 if kind == "json_object" else 48
    params = [
        constrained(kind, temperature=0.0, max_tokens=limit),
        constrained(kind, temperature=1.0, seed=7, max_tokens=limit),
        constrained(kind, temperature=0.8, top_p=0.9, n=3, max_tokens=limit),
        constrained(kind, temperature=1.0, repetition_penalty=1.2, logprobs=2, max_tokens=limit),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        # Any JSON object may nest without end on random weights: most of them must stop.
        assert_valid_outputs(kind, out, min_stopped=0 if kind == "json_object" else 1)
    stopped = sum(c.finish_reason == "stop" for o in outs for c in o.outputs)
    assert stopped >= (0 if kind == "json_object" else 4)
    assert all(c.text.startswith("{") for o in outs for c in o.outputs if kind.startswith("json"))
    assert len(outs[2].outputs) == 3
    assert_all_blocks_free(llm)


def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(llm):
    prompts = _prompts(2, 6)
    plain = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)]
    alone = llm.generate(prompts[:2], plain, use_tqdm=False)
    mixed = llm.generate(prompts, plain + [constrained(k, temperature=1.0) for k in ("json", "regex", "choice", "grammar")],
                         use_tqdm=False)
    for a, m in zip(alone, mixed[:2]):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids
    for kind, out in zip(("json", "regex", "choice", "grammar"), mixed[2:]):
        assert_valid_outputs(kind, out)
    assert_all_blocks_free(llm)


def test_seeded_constrained_request_repeats_whatever_the_batch(llm):
    prompt = _prompts(3, 1)
    params = constrained("json", temperature=1.0, seed=1234)
    alone = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    batched = llm.generate(prompt + _prompts(4, 3), [params] + [constrained("regex", temperature=1.0)] * 3,
                           use_tqdm=False)[0].outputs[0].token_ids
    assert alone == batched


def test_logprobs_are_of_the_raw_distribution(llm):
    prompt = _prompts(5, 1)
    raw = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, logprobs=3), use_tqdm=False)[0]
    masked = llm.generate(prompt, constrained("choice", temperature=0.0, logprobs=3), use_tqdm=False)[0]
    raw_top = raw.outputs[0].logprobs[0]
    masked_top = masked.outputs[0].logprobs[0]
    # The first step sees the same logits: the reported top-3 are the unmasked ones.
    for token_id, lp in raw_top.items():
        if lp.rank <= 3:
            assert masked_top[token_id].logprob == pytest.approx(lp.logprob, abs=1e-5)
    assert is_valid("choice", masked.outputs[0].text) or masked.outputs[0].finish_reason == "length"


def test_under_preemption_and_chunked_prefill(tiny_llama):
    # 24 blocks of 4 tokens cannot hold eight growing requests at once; chunks of at most 7 tokens.
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=24, max_model_len=128,
              max_num_batched_tokens=7)
    try:
        prompts = _prompts(6, 8)
        kinds = ["json", "regex", "grammar", "choice"] * 2
        _compile_ahead(llm, kinds)  # every request's grammar is ready at once: all eight run together
        outs = llm.generate(prompts, [constrained(k, temperature=1.0, seed=i, max_tokens=40) for i, k in enumerate(kinds)],
                            use_tqdm=False)
        for kind, out in zip(kinds, outs):
            assert_valid_outputs(kind, out)
        assert llm.get_stats().num_preemptions > 0
        # Recompute keeps the matcher: the same seeded requests give the same tokens without pressure.
        roomy = LLM(model=str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=256, max_model_len=128)
        try:
            again = roomy.generate(prompts, [constrained(k, temperature=1.0, seed=i, max_tokens=40)
                                             for i, k in enumerate(kinds)], use_tqdm=False)
        finally:
            roomy.shutdown()
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again]
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def _compile_ahead(llm: LLM, kinds: list[str]) -> None:
    manager = llm.llm_engine.engine_core.structured_output()
    for kind in kinds:
        manager.submit(StructuredOutputsParams(**SPECS[kind])).result(timeout=120)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"regex": "a(b"}, "structured_outputs.regex"),
        ({"json": {"type": "nonsense"}}, "structured_outputs.json"),
        ({"json": "{not json"}, "json"),
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
        ({"regex": "a", "choice": ["b"]}, "structured_outputs: exactly one of"),
        ({}, "structured_outputs: exactly one of"),
        ({"json": {"type": "object"}, "whitespace_pattern": "x+"}, "structured_outputs.whitespace_pattern"),
        ({"regex": "a", "disable_additional_properties": True}, "apply to json only"),
    ],
)
def test_bad_specs_are_value_errors_naming_the_field(llm, spec, field):
    with pytest.raises(ValueError, match="structured_outputs") as info:
        llm.generate(_prompts(7, 1), SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert field in str(info.value)
    assert_all_blocks_free(llm)


def test_failed_or_slow_compile_fails_that_request_alone(llm, monkeypatch):
    manager = llm.llm_engine.engine_core.structured_output()
    manager.start()  # the workers' start-up is not part of the short time limit below
    monkeypatch.setattr(manager, "compile_fn", faulty_compile)
    monkeypatch.setattr(manager, "compile_timeout", 0.3)
    prompts = _prompts(8, 4)
    params = [
        SamplingParams(structured_outputs={"regex": "boom"}),
        constrained("choice", temperature=1.0),
        SamplingParams(structured_outputs={"regex": "sleep:5"}),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "injected compile failure" in outs[0].error
    assert outs[2].outputs[0].finish_reason == "error" and "longer than" in outs[2].error
    assert_valid_outputs("choice", outs[1])
    assert outs[3].error is None and len(outs[3].outputs[0].token_ids) == 8
    assert_all_blocks_free(llm)


def test_equal_specs_compile_once(llm):
    manager = llm.llm_engine.engine_core.structured_output()
    spec = {"regex": r"[0-9]{4}"}
    before = manager.num_compiles
    llm.generate(_prompts(9, 3), SamplingParams(structured_outputs=spec, n=2, temperature=1.0), use_tqdm=False)
    assert manager.num_compiles == before + 1


def test_abort_while_the_grammar_compiles(llm, monkeypatch, tmp_path):
    manager = llm.llm_engine.engine_core.structured_output()
    monkeypatch.setattr(manager, "compile_fn", faulty_compile)
    release = tmp_path / "release"
    engine = llm.llm_engine
    engine.add_request("held-1", {"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(structured_outputs={"regex": f"hold:{release}"}))
    engine.add_request("plain-1", {"prompt_token_ids": [5, 6, 8]}, SamplingParams(max_tokens=3, ignore_eos=True))
    finished = {}
    for _ in range(20):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if "plain-1" in finished:
            break
    # The plain request ran to the end while the other one waited for its grammar.
    assert len(finished["plain-1"].outputs[0].token_ids) == 3 and "held-1" not in finished
    assert engine.get_stats().num_waiting == 1
    engine.abort_request("held-1")
    release.touch()
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(llm)

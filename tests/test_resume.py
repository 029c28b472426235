"""Resuming a request from the output tokens another engine emitted (engine/resume.py): the resumed
stream carries exactly what the uninterrupted stream carried after the seam (tokens, text with stop
strings held back across it, logprobs, finish reason), for greedy, seeded, n = 2, penalised,
structured-output and speculating requests, cut at several seams; and bad continuations are refused
with the field named."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import pytest

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.output_processor import OutputKind
from pagedserve.engine.resume import resume_params
from tests.structured_output_checks import SPECS, is_valid
from tests.test_engine_parity import assert_all_blocks_free
from tests.test_spec_decode import ngram, repetitive_prompts

_ids = itertools.count()


@dataclass
class Completion:
    """One completion as a DELTA stream delivered it, delta by delta."""

    deltas: list[tuple[list[int], str, list | None]] = field(default_factory=list)
    finish_reason: str | None = None
    cumulative_logprob: float | None = None

    @property
    def token_ids(self) -> list[int]:
        return [t for ids, _, _ in self.deltas for t in ids]

    @property
    def text(self) -> str:
        return "".join(text for _, text, _ in self.deltas)

    @property
    def logprobs(self) -> list:
        return [entry for _, _, lps in self.deltas for entry in (lps or [])]

    def seams(self) -> list[int]:
        """Delta boundaries with tokens on both sides (where a stream can be cut), as token counts."""
        counts = list(itertools.accumulate(len(ids) for ids, _, _ in self.deltas))
        return sorted({c for c in counts if 0 < c < len(self.token_ids)})

    def streamed_before(self, seam: int) -> tuple[list[int], str]:
        """The tokens and text a client held when the stream was cut after `seam` tokens."""
        tokens, text = [], ""
        for ids, delta_text, _ in self.deltas:
            if len(tokens) >= seam:
                break
            tokens += ids
            text += delta_text
        assert len(tokens) == seam
        return tokens, text


def stream(llm: LLM, prompt: list[int], params: SamplingParams) -> dict[int, Completion]:
    """Run one request to the end as a DELTA stream: completion index -> what it streamed."""
    engine = llm.llm_engine
    request_id = f"r{next(_ids)}"
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params, output_kind=OutputKind.DELTA)
    completions: dict[int, Completion] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == request_id and out.error is None
            for c in out.outputs:
                got = completions.setdefault(c.index, Completion())
                got.deltas.append((list(c.token_ids), c.text, c.logprobs))
                got.finish_reason = c.finish_reason or got.finish_reason
                got.cumulative_logprob = c.cumulative_logprob
    return completions


def pick_seams(seams: list[int], want: int = 3) -> list[int]:
    """The first, a middle and the last seam (fewer when the stream has fewer)."""
    if len(seams) <= want:
        return seams
    return sorted({seams[0], seams[len(seams) // 2], seams[-1]})


def assert_resumes_exactly(llm: LLM, prompt: list[int], params: SamplingParams, seams: list[int] | None = None,
                           logprob_tol: float = 1e-4) -> dict[int, Completion]:
    """Cut every completion of the uninterrupted stream at `seams` (default: three of its delta
    boundaries) and resume it: the resumed stream is exactly the rest of the uninterrupted one."""
    reference = stream(llm, prompt, params)
    assert len(reference) == params.n
    for index, full in reference.items():
        cuts = pick_seams(full.seams()) if seams is None else seams
        assert cuts, "the reference stream has no seam to cut at"
        for seam in cuts:
            emitted, text_before = full.streamed_before(seam)
            resumed = stream(llm, prompt, resume_params(params, emitted, index))
            assert list(resumed) == [0]
            rest = resumed[0]
            assert rest.token_ids == full.token_ids[seam:], f"completion {index} diverged after seam {seam}"
            assert text_before + rest.text == full.text, f"completion {index}: text differs after seam {seam}"
            assert rest.finish_reason == full.finish_reason
            if params.logprobs is not None:
                expected = full.logprobs[seam:]
                assert len(rest.logprobs) == len(expected)
                for got, want in zip(rest.logprobs, expected):
                    assert got.keys() == want.keys()
                    for token_id in want:
                        assert math.isclose(got[token_id].logprob, want[token_id].logprob,
                                            rel_tol=logprob_tol, abs_tol=logprob_tol)
    assert_all_blocks_free(llm)
    return reference


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(model=str(tiny_llama), dtype="float32", block_size=8, kv_cache_memory="16MiB")


PROMPT = [3, 17, 42, 99, 7, 250, 11, 64, 5, 301, 12]


def test_greedy_resumes_exactly(llm):
    assert_resumes_exactly(llm, PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                           seams=[1, 7, 19])


def test_seeded_sampling_resumes_exactly(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    assert_resumes_exactly(llm, PROMPT, params, seams=[1, 2, 10, 19])


def test_each_child_of_n2_resumes_on_its_own(llm):
    params = SamplingParams(n=2, temperature=1.0, seed=77, max_tokens=16, ignore_eos=True)
    reference = assert_resumes_exactly(llm, PROMPT, params, seams=[1, 9, 15])
    assert reference[0].token_ids != reference[1].token_ids


def test_logprobs_continue_after_the_seam(llm):
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=14, ignore_eos=True, logprobs=3)
    assert_resumes_exactly(llm, PROMPT, params, seams=[1, 6, 13])


def test_penalties_count_the_emitted_tokens(llm):
    params = SamplingParams(temperature=1.0, seed=9, presence_penalty=1.5, frequency_penalty=1.2,
                            repetition_penalty=1.3, min_tokens=12, max_tokens=18)
    assert_resumes_exactly(llm, PROMPT, params, seams=[1, 5, 11, 17])


def test_min_tokens_and_max_tokens_count_the_emitted_tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    resumed = stream(llm, PROMPT, resume_params(params, stream(llm, PROMPT, params)[0].token_ids[:7]))
    assert len(resumed[0].token_ids) == 3 and resumed[0].finish_reason == "length"


def test_a_stop_string_straddling_the_seam_is_held_back_and_found(llm):
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = stream(llm, PROMPT, plain)[0]
    # A stop string made of the text of output tokens 8 and 9 (the first place that text occurs).
    text_to = [len(llm.get_tokenizer().decode(full.token_ids[:k])) for k in (8, 10)]
    whole = llm.get_tokenizer().decode(full.token_ids)
    stop = whole[text_to[0]:text_to[1]]
    assert len(stop) >= 2 and whole.find(stop) == text_to[0], "pick another prompt: the stop string repeats"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    reference = assert_resumes_exactly(llm, PROMPT, params, seams=[1, 8, 9])
    assert reference[0].finish_reason == "stop" and stop not in reference[0].text
    assert len(reference[0].token_ids) == 10  # ended at the token that completed it


def test_a_json_schema_request_resumes_with_its_grammar_replayed(llm):
    for temperature, seed in ((0.0, None), (1.0, 21)):
        params = SamplingParams(structured_outputs=SPECS["json"], temperature=temperature, seed=seed, max_tokens=40)
        reference = assert_resumes_exactly(llm, PROMPT, params)
        assert reference[0].finish_reason == "stop" and is_valid("json", reference[0].text)


def test_a_speculating_engine_resumes_exactly(tiny_llama):
    spec = LLM(model=str(tiny_llama), dtype="float32", block_size=8, kv_cache_memory="16MiB",
               speculative_config=ngram(3))
    prompt = repetitive_prompts(3, [30])[0]
    reference = assert_resumes_exactly(spec, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert any(len(ids) > 1 for ids, _, _ in reference[0].deltas), "nothing was speculated"
    assert spec.get_stats().spec_decoding["num_accepted_tokens"] > 0


def test_a_final_only_resumed_output_carries_the_whole_completion(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [full] = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    [resumed] = llm.generate([{"prompt_token_ids": PROMPT}], resume_params(params, full.outputs[0].token_ids[:5]),
                             use_tqdm=False)
    assert resumed.outputs[0].token_ids == full.outputs[0].token_ids
    assert resumed.outputs[0].text == full.outputs[0].text


def test_bad_continuations_name_the_field(llm):
    with pytest.raises(ValueError, match="resume_output_token_ids.*n must be 1"):
        SamplingParams(n=2, resume_output_token_ids=[1])
    with pytest.raises(ValueError, match="resume_output_token_ids"):
        SamplingParams(resume_output_token_ids=[-1])
    with pytest.raises(ValueError, match="resume_output_token_ids.*outside the vocabulary"):
        llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(resume_output_token_ids=[10**7]), use_tqdm=False)
    with pytest.raises(ValueError, match="resume_output_token_ids.*max_tokens 4"):
        llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=4, resume_output_token_ids=[1, 2, 3, 4]),
                     use_tqdm=False)
    assert_all_blocks_free(llm)

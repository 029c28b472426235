"""Every request value that reaches a tensor or a C call is bounded up front, with the field named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedserve.engine.processor import Processor
from pagedserve.engine.sampling_params import MAX_N, MAX_STOP_STRINGS, MAX_TOKEN_LIST, SamplingParams, derive_seed

VOCAB = 100


class _Tokenizer:
    """Text -> one id per character (ord), so a word can name ids beyond the model's vocabulary."""

    eos_token_id = 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def __call__(self, text: str) -> SimpleNamespace:
        return SimpleNamespace(input_ids=self.encode(text))


def _processor(max_model_len: int = 64, policy: str = "fcfs") -> Processor:
    config = SimpleNamespace(
        model="/nonexistent", hf_config=SimpleNamespace(vocab_size=VOCAB, eos_token_id=1),
        max_model_len=max_model_len, max_logprobs=20, scheduling_policy=policy,
    )
    return Processor(config, _Tokenizer(), kv_cache_capacity_tokens=10_000)


def _process(params: SamplingParams, prompt=None, priority: int = 0, processor: Processor | None = None):
    prompt = {"prompt_token_ids": [5, 6, 7]} if prompt is None else prompt
    return (processor or _processor()).process("r", prompt, params, priority=priority)[1]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"n": MAX_N + 1}, "n"),
        ({"best_of": 0}, "best_of"),
        ({"n": 2, "best_of": 3}, "best_of"),
        ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
        ({"stop": ["x" * 1025]}, "stop"),
        ({"stop_token_ids": list(range(MAX_TOKEN_LIST + 1))}, "stop_token_ids"),
        ({"logit_bias": {i: 1.0 for i in range(MAX_TOKEN_LIST + 1)}}, "logit_bias"),
        ({"bad_words": ["x"] * (MAX_TOKEN_LIST + 1)}, "bad_words"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"top_k": -5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_sampling_params_ranges(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_extreme_accepted_values():
    SamplingParams(seed=2**64 - 1, n=MAX_N, best_of=MAX_N, top_k=2**40)
    SamplingParams(seed=-(2**63), stop=["x"] * MAX_STOP_STRINGS)


def test_engine_seed_is_a_generator_seed(tiny_llama):
    from pagedserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="seed"):
        EngineConfig(model=str(tiny_llama), seed=2**64)


def test_seed_range_is_what_torch_generators_take():
    for seed in (-(2**63), -1, 0, 2**64 - 1):
        torch.Generator().manual_seed(seed)


def test_derived_seeds_never_overflow_and_index_0_draws_like_the_parent():
    assert derive_seed(2**64 - 1, 1) == 0
    assert all(0 <= derive_seed(s, i) < 2**64 for s in (-(2**63), -1, 2**64 - 1) for i in range(MAX_N))
    assert len({derive_seed(2**64 - 2, i) for i in range(4)}) == 4
    parent = torch.Generator().manual_seed(-1)
    child = torch.Generator().manual_seed(derive_seed(-1, 0))
    assert torch.equal(torch.rand(4, generator=parent), torch.rand(4, generator=child))


@pytest.mark.parametrize(
    "params, field",
    [
        (SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias"),
        (SamplingParams(stop_token_ids=[VOCAB + 1]), "stop_token_ids"),
        (SamplingParams(allowed_token_ids=[3, VOCAB]), "allowed_token_ids"),
        (SamplingParams(bad_words=["zz"]), "bad_words"),  # 'z' = 122 >= VOCAB
        (SamplingParams(logprobs=21), "logprobs"),
        (SamplingParams(prompt_logprobs=21), "prompt_logprobs"),
        (SamplingParams(max_tokens=62), "max_tokens"),  # 3 prompt tokens + 62 > max_model_len 64
    ],
)
def test_processor_refuses_values_the_model_cannot_take(params, field):
    with pytest.raises(ValueError, match=field):
        _process(params)


def test_processor_limits_that_fit():
    request = _process(SamplingParams(max_tokens=61, bad_words=["a"], allowed_token_ids=[99]))
    assert request.max_tokens == 61 and request.bad_words_token_ids == [[97], [32, 97]]
    assert _process(SamplingParams()).max_tokens == 16  # the default max_tokens is capped, never refused
    assert _process(SamplingParams(), prompt={"prompt_token_ids": [5] * 60}).max_tokens == 4
    assert _process(SamplingParams(max_tokens=None)).max_tokens == 61


@pytest.mark.parametrize(
    "prompt, field",
    [
        ({"prompt_token_ids": [5, VOCAB]}, "prompt_token_ids"),
        ({"prompt_token_ids": [5, -1]}, "prompt_token_ids"),
        ({"prompt_token_ids": [5] * 64}, "max_model_len"),
        ({"prompt_token_ids": []}, "prompt"),
    ],
)
def test_prompt_ids_and_length(prompt, field):
    with pytest.raises(ValueError, match=field):
        _process(SamplingParams(), prompt=prompt)


@pytest.mark.parametrize("priority", [2**63, -(2**63) - 1, True, 1.5])
def test_priority_fits_int64(priority):
    with pytest.raises(ValueError, match="priority"):
        _process(SamplingParams(), priority=priority, processor=_processor(policy="priority"))


def test_priority_extremes_accepted():
    for priority in (2**63 - 1, -(2**63)):
        assert _process(SamplingParams(), priority=priority, processor=_processor(policy="priority")).priority == priority

import pytest

from pagedserve.engine.sampling_params import (
    SamplingParams,
    SamplingType,
    bad_words_token_ids,
)


def test_defaults_match_vllm():
    p = SamplingParams()
    assert p.n == 1
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == 0
    assert p.min_p == 0.0
    assert p.seed is None
    assert p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
    assert p.repetition_penalty == 1.0
    assert p.logit_bias is None
    assert p.stop == [] and p.stop_token_ids == [] and p.bad_words == []
    assert p.include_stop_str_in_output is False and p.ignore_eos is False
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens is True and p.spaces_between_special_tokens is True
    assert p.detokenize is True
    assert p.sampling_type == SamplingType.RANDOM and not p.greedy


def test_keyword_construction_and_sampling_type():
    p = SamplingParams(temperature=0, max_tokens=8)
    assert p.greedy and p.sampling_type == SamplingType.GREEDY and p.max_tokens == 8
    assert SamplingParams(temperature=1e-6).greedy
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(max_tokens=None).max_tokens is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": 2.1}, "frequency_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"stop": "x", "detokenize": False}, "detokenize"),
        ({"not_a_field": 1}, "not_a_field"),
    ],
)
def test_bad_values_raise_value_error_naming_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_boundaries_accepted():
    SamplingParams(top_k=-1)
    SamplingParams(top_k=1, top_p=1.0, min_p=1.0, min_tokens=4, max_tokens=4)
    SamplingParams(presence_penalty=-2, frequency_penalty=2, logprobs=0, prompt_logprobs=0)
    SamplingParams(min_tokens=100, max_tokens=None)


def test_stop_normalized_to_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(bad_words=None).bad_words == []


def test_logit_bias_accepts_json_keys_and_clamps():
    p = SamplingParams(logit_bias={"7": 250.0, "3": -1000, 5: 1.5})
    assert p.logit_bias == {7: 100.0, 3: -100.0, 5: 1.5}


def test_validate_on_assignment():
    p = SamplingParams()
    p.temperature = 0.0
    assert p.greedy
    with pytest.raises(ValueError, match="top_p"):
        p.top_p = 0.0
    p.stop = "x"
    assert p.stop == ["x"]


def test_clone_is_deep():
    p = SamplingParams(stop=["a"], logit_bias={1: 2.0})
    q = p.clone()
    assert q == p
    q.stop.append("b")
    q.logit_bias[2] = 1.0
    assert p.stop == ["a"] and p.logit_bias == {1: 2.0}


def test_verify_vocab():
    SamplingParams(logit_bias={9: 1.0}, stop_token_ids=[9]).verify_vocab(10)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={10: 1.0}).verify_vocab(10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[12]).verify_vocab(10)


class _WordTokenizer:
    """Maps each whitespace-prefixed or bare word piece to an id, like a tiny BPE."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        pieces = []
        for i, word in enumerate(text.split(" ")):
            if word:
                pieces.append(("Ġ" if i > 0 else "") + word)
        return [self.vocab.setdefault(p, len(self.vocab)) for p in pieces]


def test_bad_words_token_ids_with_and_without_leading_space():
    tok = _WordTokenizer()
    ids = bad_words_token_ids(["hello", " two words"], tok)
    hello, sp_hello = tok.vocab["hello"], tok.vocab["Ġhello"]
    two, sp_two, sp_words = tok.vocab["two"], tok.vocab["Ġtwo"], tok.vocab["Ġwords"]
    assert ids == [[hello], [sp_hello], [two, sp_words], [sp_two, sp_words]]
    assert bad_words_token_ids([], tok) == []

"""Per-request sampling parameters: the vLLM-compatible `SamplingParams` surface.

Validation happens once, here, at construction (and on assignment), so the sampler
and detokenizer can trust every field. Errors are pydantic `ValidationError`s, which
subclass `ValueError`, and always name the offending field.

Ranges (the HTTP API mirrors them): n and best_of in [1, 128] (best_of == n only);
seed in [-2**63, 2**64 - 1] (what torch.Generator takes; children of n > 1 use
`derive_seed`); top_k -1 or 0 (disabled) or >= 1 (the sampler clamps it to the
vocabulary); max_tokens >= 1; at most 64 stop strings of at most 1024 characters; at most 1024 entries in each of
logit_bias, stop_token_ids, bad_words, allowed_token_ids; logit_bias values clamped to
[-100, 100]. Limits that need the model (token ids in [0, vocab), logprobs <=
max_logprobs, lengths vs max_model_len) are checked by the processor, and so is whether a
structured_outputs schema, regex or grammar parses.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagedserve.engine.structured_output.params import StructuredOutputsParams

# Temperatures below this are treated as greedy (argmax) sampling, as in vLLM.
GREEDY_TEMPERATURE_EPS = 1e-5
# Biases are clamped to [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT] (the OpenAI range).
LOGIT_BIAS_LIMIT = 100.0
# Every value torch.Generator.manual_seed accepts: negative seeds act as their two's complement.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
# Completions per request (n, best_of): OpenAI's limit.
MAX_N = 128
# Stop strings per request, and characters per stop string: each is searched in every step's new text.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
# Entries in logit_bias, stop_token_ids, bad_words and allowed_token_ids: bounds per-step work.
MAX_TOKEN_LIST = 1024
# bad_words in all: characters (each is tokenized twice) and tokens of the sequences they encode to.
MAX_BAD_WORDS_CHARS = 64 * 1024
MAX_BAD_WORDS_TOKENS = 4096


def derive_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of an n > 1 request: distinct per index, always a valid
    generator seed (wraps modulo 2**64; index 0 draws exactly what the parent seed draws)."""
    return (seed + index) % 2**64


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


class SamplingParams(BaseModel):
    """How to sample the tokens of one request (defaults as in vLLM)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    n: int = Field(default=1, ge=1, le=MAX_N)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)  # only best_of == n (or None) is supported
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = 0  # 0 or -1 disable; otherwise >= 1 (above the vocabulary: the whole vocabulary)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logit_bias: dict[int, float] | None = Field(default=None, max_length=MAX_TOKEN_LIST)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_TOKEN_LIST)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = Field(default=16, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    logprobs: int | None = Field(default=None, ge=0)
    prompt_logprobs: int | None = Field(default=None, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    bad_words: list[str] = Field(default_factory=list, max_length=MAX_TOKEN_LIST)
    # Only these tokens may be sampled (vLLM's allowed_token_ids); None = the whole vocabulary.
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1, max_length=MAX_TOKEN_LIST)
    detokenize: bool = True
    # Constrain the output to a JSON schema, any JSON, a regex, a choice or an EBNF grammar.
    structured_outputs: StructuredOutputsParams | None = None
    # Prefill/decode disaggregation (vLLM's kv_transfer_params): {"do_remote_decode": True} asks a
    # producer engine to keep the prompt's KV for a reader; a producer's output params (which carry
    # "do_remote_prefill": True) make a consumer engine load the prompt's KV instead of computing it.
    kv_transfer_params: dict[str, Any] | None = None
    # Migration (engine/resume.py): output tokens an earlier engine already emitted for this request,
    # which this engine takes as its own first output tokens and continues after (n == 1 only).
    resume_output_token_ids: list[int] | None = None

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or >= 1, got {v}")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _normalize_stop(cls, v: Any) -> Any:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop must not contain an empty string")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in v):
            raise ValueError(f"stop strings must have at most {MAX_STOP_STRING_CHARS} characters")
        return v

    @field_validator("stop_token_ids", "bad_words", mode="before")
    @classmethod
    def _none_to_list(cls, v: Any) -> Any:
        return [] if v is None else v

    @field_validator("bad_words")
    @classmethod
    def _check_bad_words(cls, v: list[str]) -> list[str]:
        total = sum(len(word) for word in v)
        if total > MAX_BAD_WORDS_CHARS:
            raise ValueError(f"bad_words must have at most {MAX_BAD_WORDS_CHARS} characters in all, got {total}")
        return v

    @field_validator("stop_token_ids", "allowed_token_ids", "resume_output_token_ids")
    @classmethod
    def _check_token_ids(cls, v: list[int] | None, info: Any) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError(f"{info.field_name} must be non-negative, got {[t for t in v if t < 0][:8]}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _clamp_logit_bias(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        # JSON object keys arrive as strings; pydantic has already coerced them to int.
        if v is None:
            return None
        out: dict[int, float] = {}
        for token_id, bias in v.items():
            if token_id < 0:
                raise ValueError(f"logit_bias token ids must be non-negative, got {token_id}")
            out[token_id] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, bias))
        return out

    @model_validator(mode="after")
    def _check_cross_fields(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.stop and not self.detokenize:
            raise ValueError("stop strings require detokenize=True")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: only best_of == n is supported (got best_of={self.best_of}, n={self.n})")
        if self.resume_output_token_ids is not None and self.n != 1:
            raise ValueError("resume_output_token_ids: a resumed request carries one completion's tokens; n must be 1")
        return self

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    def clone(self) -> SamplingParams:
        return self.model_copy(deep=True)

    def child(self, index: int) -> SamplingParams:
        """The n == 1 params of completion `index` of this request (its own seed when seeded)."""
        child = self.model_copy(update={"n": 1, "best_of": None})
        if self.seed is not None:
            child.seed = derive_seed(self.seed, index)  # distinct but reproducible samples
        return child

    def verify_vocab(self, vocab_size: int) -> None:
        """Reject token ids the model cannot produce (call once the vocab size is known)."""
        for name, ids in (
            ("logit_bias", list(self.logit_bias or ())),
            ("stop_token_ids", self.stop_token_ids),
            ("allowed_token_ids", self.allowed_token_ids or []),
        ):
            check_token_ids(name, ids, vocab_size)


def check_token_ids(name: str, ids: list[int], vocab_size: int) -> None:
    """ValueError naming `name` unless every id is in [0, vocab_size)."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name}: token ids {bad[:8]} are outside the vocabulary [0, {vocab_size})")


def bad_words_token_ids(bad_words: list[str], tokenizer: _Encoder) -> list[list[int]]:
    """Token sequences to ban for each bad word: as encoded at the start of a text and
    after a space (byte-level and sentencepiece tokenizers encode the two differently).
    ValueError naming bad_words when they come to more than MAX_BAD_WORDS_TOKENS tokens."""
    sequences: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    total = 0
    for word in bad_words:
        stripped = word.lstrip()
        for text in (stripped, " " + stripped):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and tuple(ids) not in seen:
                seen.add(tuple(ids))
                sequences.append(ids)
                total += len(ids)
                if total > MAX_BAD_WORDS_TOKENS:
                    raise ValueError(f"bad_words: they encode to more than {MAX_BAD_WORDS_TOKENS} tokens in all "
                                     "(each word counts as it starts a text and as it follows a space)")
    return sequences

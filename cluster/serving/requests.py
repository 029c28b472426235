"""OpenAI-compatible request bodies (completions, chat, tokenize, detokenize).

Request models accept unknown fields (clients send OpenAI fields we do not implement)
and log a warning naming them, as vLLM does; fields we recognise but cannot honour
(`suffix`, `tools`, a JSON `response_format`, ...) are rejected with a ValueError naming
the field, which the server turns into a 400.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagedserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_N = 64


class OpenAIRequest(BaseModel):
    """Base of every request body: unknown fields are accepted, ignored and logged."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    @model_validator(mode="after")
    def _warn_unknown_fields(self) -> "OpenAIRequest":
        if self.model_extra:
            logger.warning("%s: ignoring unknown fields %s", type(self).__name__, sorted(self.model_extra))
        return self

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far


class SamplingRequest(OpenAIRequest):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    priority: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            try:
                int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        return v

    @model_validator(mode="after")
    def _check_stream_options(self) -> "SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every streamed chunk (vLLM's `stream_options.continuous_usage_stats`)."""
        return bool(self.stream and self.stream_options and self.stream_options.continuous_usage_stats)

    def requested_max_tokens(self) -> int | None:
        raise NotImplementedError

    def requested_logprobs(self) -> int | None:
        raise NotImplementedError

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """Engine sampling parameters; raises pydantic's ValidationError (a ValueError) naming the field."""
        values: dict[str, Any] = dict(
            n=self.n,
            seed=self.seed,
            stop=self.stop,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=self.requested_logprobs(),
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            stop_token_ids=self.stop_token_ids,
            bad_words=self.bad_words,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
        )
        optional = dict(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
        )
        values.update({k: v for k, v in optional.items() if v is not None})
        return SamplingParams(**values)


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingRequest):
    prompt: PromptInput
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, v: Any) -> Any:
        """One clear message instead of pydantic's per-union-member errors."""
        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, str):
            return v
        if isinstance(v, list) and v and (all(isinstance(p, str) for p in v) or is_ids(v)
                                          or all(is_ids(p) for p in v)):
            return v
        raise ValueError("expected a string, a list of strings, a list of token ids, or a list of token-id lists "
                         "(all non-empty)")

    @model_validator(mode="after")
    def _check_unsupported(self) -> "CompletionRequest":
        if self.suffix:
            raise ValueError("suffix: not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n is supported")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo: echo together with logprobs is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return self.logprobs


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessageParam(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"messages: content parts of type {part.type!r} are not supported (text only)")
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat_fields(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if self.tools:
            raise ValueError("tools: tool calling is not supported")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format: only {'type': 'text'} is supported")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be combined with add_generation_prompt=true")
        return self

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class TokenizeRequest(OpenAIRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        return self


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[int]

"""The HTTP service's wire format: OpenAI-compatible request/response models, and `ServeArgs`.

Request models accept unknown fields (clients send OpenAI fields we do not implement)
and log a warning naming them, as vLLM does; fields we recognise but cannot honour
(`suffix`, `tools`, a JSON `response_format`, ...) are rejected with a ValueError naming
the field, which the server turns into a 400. `ServeArgs` is the one validated
configuration behind both `pagedserve serve` and the Serve app builder.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

API_KEY_ENV = "PAGEDSERVE_API_KEY"
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "default-model"
DEFAULT_MODEL_NAME = "pagedserve-default"
MAX_N = 64


# --------------------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# --------------------------------------------------------------------------- requests


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


# --------------------------------------------------------------------------- responses


def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class ChatMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagedserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# --------------------------------------------------------------------------- serve configuration


def _api_key_from_env() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


class ServeArgs(EngineConfig):
    """`pagedserve serve` / `build_app` arguments: the engine's `EngineConfig` fields plus the service's."""

    model: str | None = Field(default=None, validate_default=True)  # type: ignore[assignment]
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    address: str | None = None
    data_parallel_size: int = Field(default=1, ge=1)
    api_key: str | None = Field(default_factory=_api_key_from_env, repr=False)
    # What the replicas get instead of the key itself (Serve shows deployment args in its status).
    api_key_sha256: str | None = Field(default=None, repr=False, pattern=r"^[0-9a-f]{64}$")
    max_pending_requests: int = Field(default=1024, ge=1)
    num_cpus_per_engine: float = Field(default=1.0, ge=0.0)
    app_name: str = "pagedserve"

    @field_validator("model")
    @classmethod
    def _resolve_model(cls, v: str | None) -> str:
        if v is None:
            if not (DEFAULT_MODEL_DIR / "config.json").is_file():
                raise ValueError(
                    f"no MODEL given and the bundled default model is missing at {DEFAULT_MODEL_DIR}; "
                    "pass a model directory (an HF-format folder with config.json and safetensors)"
                )
            return str(DEFAULT_MODEL_DIR)
        if not os.path.isdir(v):
            raise ValueError(f"{v!r} is not a local directory (pagedserve loads HF-format folders)")
        return v

    @property
    def model_name(self) -> str:
        """The name clients put in `model` (served_model_name, else the model argument as given)."""
        if self.served_model_name:
            return self.served_model_name
        if Path(self.model) == DEFAULT_MODEL_DIR:  # type: ignore[arg-type]
            return DEFAULT_MODEL_NAME
        return self.model  # type: ignore[return-value]

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `EngineConfig`: the engine fields that were set, plus the model."""
        fields = set(EngineConfig.model_fields) - {"hf_config"}
        kwargs = {k: getattr(self, k) for k in fields if k in self.model_fields_set}
        kwargs["model"] = self.model
        return kwargs

    @property
    def api_key_digest(self) -> str | None:
        """SHA-256 (hex) of the API key requests must present, or None when none is required."""
        if self.api_key_sha256 is not None:  # shipped by to_dict: wins over a key in the replica's environment
            return self.api_key_sha256
        if self.api_key is not None:
            return hashlib.sha256(self.api_key.encode()).hexdigest()
        return None

    def to_dict(self) -> dict[str, Any]:
        """Plain values for `build_app(args)` (what a Serve config's `args:` would hold). The API key
        (resolved from the environment here, not in the replica's) travels as its SHA-256 only."""
        values = self.model_dump(exclude={"hf_config", "api_key"}, exclude_unset=True) | {"model": self.model}
        if self.api_key_digest is not None:
            values["api_key_sha256"] = self.api_key_digest
        return values

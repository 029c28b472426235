"""OpenAI-compatible response bodies, and the OpenAI error body."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


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


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


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


class FunctionCall(BaseModel):
    name: str
    arguments: str  # the arguments object as JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


def _is_none(value: object) -> bool:
    return value is None


class DeltaFunctionCall(BaseModel):
    name: str | None = Field(default=None, exclude_if=_is_none)
    arguments: str | None = Field(default=None, exclude_if=_is_none)


class DeltaToolCall(BaseModel):
    """A streamed piece of a call: its first carries id, type and name, the rest argument fragments."""

    index: int
    id: str | None = Field(default=None, exclude_if=_is_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=_is_none)
    function: DeltaFunctionCall


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=_is_none)


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
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


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
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None
    # Which default model this is and why it is served (None for a model the operator named).
    description: str | None = None
    # What the model serves: the endpoint families ("completions", "chat", "embeddings", ...).
    capabilities: list[str] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str

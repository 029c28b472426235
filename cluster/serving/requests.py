"""OpenAI-compatible request bodies (completions, chat, tokenize, detokenize).

Every numeric field carries the range the engine can honour, so a bad value is a 400 naming the
field before anything runs; limits that depend on the server (`max_n`, `max_logprobs`, the
vocabulary) are checked by `OpenAIServing`. Text that is not valid Unicode is refused. Unknown
fields are accepted, ignored and logged with the request id, as vLLM does; fields we recognise but
do not implement (`suffix`, `functions`, `use_beam_search`, ...) are refused with a ValueError naming
the field, which the server turns into a 400.

Chat's tool_choice "required" or a named function is an output constraint too (the call's JSON schema,
`engine/tool_parsers/tool_spec.py`; named `tools` in errors); the server's part is `tools.py`.

Structured output comes from `response_format` (`json_object`, or `json_schema` with its `schema`)
or vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` / `structured_outputs`:
at most one per request, turned into the engine's `StructuredOutputsParams`; a spec that does not
parse, or is over the grammar size limits (`engine/structured_output/limits.py`), is a 400 naming
the request field it came from (`response_format.json_schema`, `guided_regex`, ...).
"""

from __future__ import annotations

import logging
import re
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pagedserve.cluster.settings import MAX_PROMPTS
from pagedserve.cluster.serving.chat_messages import ChatMessageParam
from pagedserve.cluster.serving.context import current_request_id
from pagedserve.cluster.serving.validation import (
    INT64_MAX,
    INT64_MIN,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOKEN_LIST,
    MAX_TOKENS_LIMIT,
    MAX_USER_CHARS,
    SEED_MAX,
    SEED_MIN,
    TOKEN_ID_MAX,
    UNSUPPORTED_FIELDS,
    check_text_encodable,
    unsupported_field,
)
from pagedserve.engine.processor import CACHE_SALT_MAX_CHARS
from pagedserve.engine.sampling_params import MAX_BAD_WORDS_CHARS, SamplingParams
from pagedserve.engine.structured_output.params import StructuredOutputsParams
from pagedserve.engine.tool_parsers import tool_spec

logger = logging.getLogger(__name__)

# A static ceiling on n / best_of / logprobs; the server's own limits (`ServeArgs`) are lower.
MAX_N = 1024
MAX_LOGPROBS = 1024
# Below this a temperature is greedy: dividing logits by it would overflow.
GREEDY_TEMPERATURE = 1e-5

TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
_TOKEN_KEY = re.compile(r"[0-9]{1,10}")
# OpenAI's rule for response_format.json_schema.name.
_SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# The engine's own field prefix on a spec error ("structured_outputs.regex: ..."), replaced by the request field.
_SPEC_PREFIX = re.compile(r"^structured_outputs(\.\w+)?: ")


class OpenAIRequest(BaseModel):
    """Base of every request body: valid Unicode only; unknown fields accepted, ignored and logged."""

    model_config = ConfigDict(extra="allow", protected_namespaces=(), allow_inf_nan=False)
    # Fields of UNSUPPORTED_FIELDS that this request type does implement.
    SUPPORTED_FIELDS: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _check_raw_body(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_text_encodable(data)
            name = unsupported_field(data, skip=cls.SUPPORTED_FIELDS)
            if name is not None:
                raise ValueError(f"{name}: not supported by this server")
        return data

    @model_validator(mode="after")
    def _warn_unknown_fields(self) -> "OpenAIRequest":
        ignored = self.ignored_fields()
        if ignored:
            names = [name[:64] for name in ignored[:16]]  # bounded: the names come from the client
            if len(ignored) > 16:
                names.append(f"... {len(ignored) - 16} more")
            logger.warning("request %s: %s: ignoring unknown fields %s", current_request_id(),
                           type(self).__name__, names)
        return self

    def ignored_fields(self) -> list[str]:
        """Fields we do not know (known-but-unset unsupported ones, like tools=[], are not listed)."""
        return sorted(k for k in self.model_extra or {} if k not in UNSUPPORTED_FIELDS)


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far


class SamplingRequest(OpenAIRequest):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Bias] | None = Field(default=None, max_length=MAX_TOKEN_LIST)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: StopString | list[StopString] | None = Field(default=None)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    response_format: dict[str, Any] | None = None
    # vLLM extras
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_LIMIT)
    ignore_eos: bool = False
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=100.0)
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    # Prefix-cache isolation: only requests with the same salt share cached prompt blocks.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=CACHE_SALT_MAX_CHARS)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_TOKEN_LIST)
    bad_words: list[StopString] | None = Field(default=None, max_length=MAX_TOKEN_LIST)
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1, max_length=MAX_TOKEN_LIST)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    truncate_prompt_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    # vLLM extras: structured output (at most one constraint, response_format included)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    @field_validator("stop")
    @classmethod
    def _bound_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(v)}")
        return v

    @field_validator("bad_words", mode="before")
    @classmethod
    def _bound_bad_words(cls, v: Any) -> Any:
        """At most MAX_BAD_WORDS_CHARS characters in all, counted before the words are validated."""
        if isinstance(v, list):
            total = sum(len(w) for w in v if isinstance(w, str))
            if total > MAX_BAD_WORDS_CHARS:
                raise ValueError(f"at most {MAX_BAD_WORDS_CHARS} characters of bad words in all, got {total}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not _TOKEN_KEY.fullmatch(key) or int(key) > TOKEN_ID_MAX:
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        return v

    @model_validator(mode="after")
    def _check_shared(self) -> "SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        self.structured_output_spec()
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not supported with stream=true")
        return self

    @property
    def has_output_constraint(self) -> bool:
        fmt = (self.response_format or {}).get("type", "text")
        guided = (self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar, self.structured_outputs)
        return fmt != "text" or any(g is not None for g in guided) or self.forced_tool_schema() is not None

    def forced_tool_schema(self) -> dict[str, Any] | None:
        """The schema a forced tool call (chat's tool_choice "required" or a named function) constrains to."""
        return None

    def structured_output_spec(self) -> tuple[str, StructuredOutputsParams] | None:
        """The request's output constraint and the field it came from; ValueError naming that field."""
        found: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type", "text")
            if kind == "json_object":
                found.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":  # named in errors as the sub-field that holds the schema
                found.append(("response_format.json_schema", {"json": _json_schema_of(fmt.get("json_schema"))}))
            elif kind != "text":
                raise ValueError(f"response_format: type {str(kind)[:64]!r} is not supported "
                                 "(use 'text', 'json_object' or 'json_schema')")
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                found.append((name, {key: getattr(self, name)}))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", dict(self.structured_outputs)))
        forced = self.forced_tool_schema()
        if forced is not None:
            found.append(("tools", {"json": forced, "whitespace_pattern": tool_spec.FORCED_CALL_WHITESPACE}))
        if len(found) > 1:
            name = "tool_choice" if found[1][0] == "tools" else found[1][0]
            raise ValueError(f"{name}: only one output constraint per request (also got {found[0][0]})")
        if not found:
            if self.guided_whitespace_pattern is not None:
                raise ValueError("guided_whitespace_pattern: needs a JSON constraint (guided_json or response_format)")
            return None
        field_name, spec = found[0]
        if self.guided_whitespace_pattern is not None and ("json" in spec or "json_object" in spec):
            spec["whitespace_pattern"] = self.guided_whitespace_pattern
        try:
            return field_name, StructuredOutputsParams(**spec)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(p) for p in error.get("loc", ()))
            message = _SPEC_PREFIX.sub("", str(error.get("msg", "")).removeprefix("Value error, "))
            raise ValueError(f"{field_name}: {where + ': ' if where else ''}{message}") from None

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

    def logprobs_field(self) -> str:
        """The field that asked for sample logprobs (named in errors)."""
        raise NotImplementedError

    def to_sampling_params(self, max_tokens: int | None, vocab_size: int | None = None) -> SamplingParams:
        """Engine sampling parameters; raises pydantic's ValidationError (a ValueError) naming the field.
        A top_k above the vocabulary is the whole vocabulary."""
        values: dict[str, Any] = dict(
            n=self.n,
            seed=self.seed,
            stop=self.stop,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=self.requested_logprobs(),
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            stop_token_ids=self.stop_token_ids,
            bad_words=self.bad_words,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
        )
        top_k = self.top_k
        if top_k is not None and vocab_size is not None and top_k > vocab_size:
            top_k = vocab_size
        temperature = self.temperature
        if temperature is not None and temperature < GREEDY_TEMPERATURE:
            temperature = 0.0
        optional = dict(
            temperature=temperature,
            top_p=self.top_p,
            top_k=top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            allowed_token_ids=self.allowed_token_ids,
        )
        values.update({k: v for k, v in optional.items() if v is not None})
        constraint = self.structured_output_spec()
        if constraint is not None:
            field_name, spec = constraint
            from pagedserve.engine.structured_output.grammar import check_spec  # xgrammar loads lazily

            try:
                check_spec(spec)
            except ValueError as exc:
                raise ValueError(f"{field_name}: {_SPEC_PREFIX.sub('', str(exc))}") from None
            values["structured_outputs"] = spec
        return SamplingParams(**values)


def _json_schema_of(json_schema: Any) -> dict[str, Any] | str:
    """The schema of an OpenAI `response_format.json_schema` object ({"name", "schema", "strict", ...})."""
    if not isinstance(json_schema, dict):
        raise ValueError("response_format: type 'json_schema' needs a json_schema object with a name and a schema")
    name = json_schema.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise ValueError("response_format: json_schema.name must be 1 to 64 letters, digits, '_' or '-'")
    schema = json_schema.get("schema")
    if not isinstance(schema, (dict, str)):
        raise ValueError("response_format: json_schema.schema must be a JSON schema object")
    return schema


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingRequest):
    prompt: PromptInput
    max_tokens: int | None = Field(default=16, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    add_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _bound_prompts(cls, data: Any) -> Any:
        """At most MAX_PROMPTS prompts, counted before anything looks at each one."""
        if isinstance(data, dict):
            prompts = data.get("prompt")
            if isinstance(prompts, list) and len(prompts) > MAX_PROMPTS and not _is_ids(prompts[:1]):
                raise ValueError(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
        return data

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, v: Any) -> Any:
        """One clear message instead of pydantic's per-union-member errors."""
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v and (all(isinstance(p, str) for p in v) or _is_ids(v)
                                          or all(_is_ids(p) for p in v)):
            ids = v if _is_ids(v) else [t for p in v if isinstance(p, list) for t in p]
            if any(t < 0 or t > TOKEN_ID_MAX for t in ids):
                raise ValueError(f"token ids must be in [0, {TOKEN_ID_MAX}]")
            return v
        raise ValueError("expected a string, a list of strings, a list of token ids, or a list of token-id lists "
                         "(all non-empty)")

    @model_validator(mode="after")
    def _check_unsupported(self) -> "CompletionRequest":
        if self.suffix:
            raise ValueError("suffix: not supported by this server")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of: must be >= n ({self.n}), got {self.best_of}")
        if self.best_of is not None and self.best_of > self.n:
            raise ValueError("best_of: best_of > n is not supported by this server")
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

    def logprobs_field(self) -> str:
        return "logprobs"


class ChatCompletionRequest(SamplingRequest):
    SUPPORTED_FIELDS: ClassVar[frozenset[str]] = frozenset({"tools", "tool_choice"})

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template places special tokens itself (vLLM's default)
    chat_template: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_chat_fields(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if (self.model_extra or {}).get("echo"):
            raise ValueError("echo: not supported for chat completions by this server")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be combined with add_generation_prompt=true")
        self.effective_tool_choice()
        return self

    def tool_definitions(self) -> list[tool_spec.ToolDefinition]:
        """The request's tools, validated (ValueError naming `tools[i]...`); [] when none."""
        return tool_spec.parse_tools(self.tools) if self.tools else []

    def effective_tool_choice(self) -> str | dict[str, Any]:
        """tool_choice as given, else "auto" with tools and "none" without (OpenAI's defaults); a choice
        other than "none" needs tools, a named one a tool of that name."""
        tools = self.tool_definitions()
        choice = self.tool_choice
        if choice is None:
            return "auto" if tools else "none"
        if not tools and choice != "none":
            raise ValueError("tool_choice: needs tools (the request has none)")
        tool_spec.named_choice(choice, tools)
        return choice

    def forced_tool_schema(self) -> dict[str, Any] | None:
        choice = self.effective_tool_choice()
        if choice in ("none", "auto"):
            return None
        tools = self.tool_definitions()
        return tool_spec.forced_call_schema(tools, tool_spec.named_choice(choice, tools), self.parallel_tool_calls)

    def conversation(self) -> list[dict[str, Any]]:
        return tool_spec.messages_for_template([m.for_template() for m in self.messages])

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def logprobs_field(self) -> str:
        return "top_logprobs"

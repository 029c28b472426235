"""`SpeculativeConfig`: what to speculate with, in vLLM's `--speculative-config` shape.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 3}

As in vLLM, `method` may be left out when `model` is given (it is then "draft_model"), and the ngram
window follows vLLM's defaults: both bounds unset -> both 5; one set -> the other takes its value.
Options that belong to the other method are errors rather than silently ignored.

`parse_speculative_config` accepts a dict, a JSON string (the CLI), a config or None, and raises
ValueError messages that start with `speculative_config.<field>:` (or `speculative_config:` for the
object as a whole), the form the engine and the OpenAI server report.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

__all__ = [
    "DEFAULT_PROMPT_LOOKUP",
    "SpeculativeConfig",
    "check_draft_compatible",
    "load_draft_hf_config",
    "parse_speculative_config",
]

# vLLM's default ngram window when neither bound is given (both min and max).
DEFAULT_PROMPT_LOOKUP = 5

_PREFIX = "speculative_config"
_NGRAM_ONLY = ("prompt_lookup_max", "prompt_lookup_min")


class SpeculativeConfig(BaseModel):
    """Speculative decoding settings; see the module docstring for the accepted shapes."""

    # strict: no silent coercion of "3" or True into an int (a JSON config says what it means).
    model_config = ConfigDict(extra="forbid", strict=True)

    method: Literal["ngram", "draft_model"]
    num_speculative_tokens: int = Field(ge=1)
    # A local HF-format folder (or GGUF file) with the draft model; draft_model only.
    model: str | None = Field(default=None, validate_default=True)
    # The ngram window: the longest suffix tried first, down to the shortest (ngram only).
    prompt_lookup_max: int | None = Field(default=None, ge=1)
    prompt_lookup_min: int | None = Field(default=None, ge=1)
    # The draft runs unsharded beside the target's rank 0; only 1 is supported.
    draft_tensor_parallel_size: int | None = None
    # Speculation is off for a step when this many requests (or more) are running.
    disable_by_batch_size: int | None = Field(default=None, ge=2)

    @model_validator(mode="before")
    @classmethod
    def _fill_defaults(cls, data: Any) -> Any:
        """Infer `method` from `model` and fill the ngram window the way vLLM does."""
        if not isinstance(data, dict):
            return data  # pydantic reports the type error for the whole object
        data = dict(data)
        if data.get("method") is None and data.get("model") is not None:
            data["method"] = "draft_model"
        if data.get("method") == "ngram":
            lo, hi = data.get("prompt_lookup_min"), data.get("prompt_lookup_max")
            if lo is None and hi is None:
                data["prompt_lookup_min"] = data["prompt_lookup_max"] = DEFAULT_PROMPT_LOOKUP
            elif lo is None and _usable_bound(hi):
                data["prompt_lookup_min"] = hi
            elif hi is None and _usable_bound(lo):
                data["prompt_lookup_max"] = lo
        return data

    @field_validator("model")
    @classmethod
    def _check_model(cls, value: str | None, info: ValidationInfo) -> str | None:
        method = info.data.get("method")
        if method == "draft_model":
            if value is None or not value.strip():
                raise ValueError("method 'draft_model' needs the path of a local draft model folder")
        elif method == "ngram" and value is not None:
            raise ValueError("method 'ngram' proposes from the request's own tokens and takes no model; "
                             "leave model out (or use method 'draft_model')")
        return value

    @field_validator("prompt_lookup_max", "prompt_lookup_min")
    @classmethod
    def _check_lookup(cls, value: int | None, info: ValidationInfo) -> int | None:
        method = info.data.get("method")
        if method is not None and method != "ngram" and value is not None:
            raise ValueError(f"only used by method 'ngram' (method is {method!r})")
        if info.field_name == "prompt_lookup_min" and value is not None:
            hi = info.data.get("prompt_lookup_max")
            if hi is not None and value > hi:
                raise ValueError(f"{value} is larger than prompt_lookup_max {hi}")
        return value

    @field_validator("draft_tensor_parallel_size")
    @classmethod
    def _check_draft_tp(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError(f"only 1 is supported (the draft runs unsharded); got {value}")
        return value


def _usable_bound(value: Any) -> bool:
    """A bound worth copying to the other one (a bad one is reported once, under its own name)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _field_error(error: dict[str, Any]) -> str:
    loc = ".".join(str(part) for part in error.get("loc", ()))
    msg = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{_PREFIX}.{loc}: {msg}" if loc else f"{_PREFIX}: {msg}"


def parse_speculative_config(value: dict | str | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """A validated config from a dict, a JSON object string (`--speculative-config '{...}'`), a config
    (returned as is) or None / JSON null (no speculation). Errors are ValueErrors naming the field."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{_PREFIX}: not valid JSON ({exc})") from None
        if value is None:
            return None
    if not isinstance(value, dict):
        raise ValueError(f"{_PREFIX}: expected a JSON object (a dict), got {type(value).__name__}")
    try:
        return SpeculativeConfig.model_validate(value)
    except ValidationError as exc:
        # The first error leads (so the message starts with its field); the others follow.
        raise ValueError("; ".join(_field_error(e) for e in exc.errors())) from None


def load_draft_hf_config(spec: SpeculativeConfig) -> Any:
    """The draft model's HF config (config.json via AutoConfig, or a GGUF file's metadata)."""
    from transformers import AutoConfig

    from pagedserve.engine.models.gguf_config import gguf_hf_config
    from pagedserve.engine.models.gguf_loader import find_gguf_file

    path = spec.model
    if spec.method != "draft_model" or path is None:
        raise ValueError(f"{_PREFIX}.model: method {spec.method!r} has no draft model to load")
    if not os.path.exists(path):
        raise ValueError(f"{_PREFIX}.model: {path!r} does not exist (the draft is a local HF-format folder "
                         "or a GGUF file)")
    try:
        gguf_file = find_gguf_file(path)
        if gguf_file is not None:
            return gguf_hf_config(gguf_file)
        if not os.path.isdir(path):
            raise ValueError("neither a directory nor a .gguf file")
        return AutoConfig.from_pretrained(path)
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError for a bad folder
        detail = str(exc).removeprefix("model: ")
        raise ValueError(f"{_PREFIX}.model: cannot load the draft model's config from {path!r}: {detail}") from exc


def check_draft_compatible(spec: SpeculativeConfig, target_hf_config: Any, draft_hf_config: Any) -> None:
    """Drafts are token ids the target verifies, so both models must share one vocabulary."""
    if spec.method != "draft_model":
        return
    target_vocab = _vocab_size(target_hf_config)
    draft_vocab = _vocab_size(draft_hf_config)
    if draft_vocab is None:
        raise ValueError(f"{_PREFIX}.model: the draft model's config has no vocab_size")
    if target_vocab is not None and draft_vocab != target_vocab:
        raise ValueError(
            f"{_PREFIX}.model: the draft's vocab_size {draft_vocab} differs from the target's vocab_size "
            f"{target_vocab}; a draft model must share the target's tokenizer and vocabulary"
        )


def _vocab_size(hf_config: Any) -> int | None:
    size = getattr(hf_config, "vocab_size", None)
    if size is None and hasattr(hf_config, "get_text_config"):
        size = getattr(hf_config.get_text_config(), "vocab_size", None)
    return int(size) if size is not None else None

"""Checks every request body gets before its fields are parsed: text that cannot be encoded, and
fields we know but do not implement (refused rather than silently ignored)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

# Bounds of the integer fields: what a 64-bit engine value or torch generator seed holds.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
TOKEN_ID_MAX = 2**31 - 1  # token ids are stored as int32 (vocabularies are far smaller)
MAX_TOKENS_LIMIT = 2**31 - 1
# Lists and strings of sampling controls: each one costs work on every engine step.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_TOKEN_LIST = 1024
MAX_USER_CHARS = 1024
# MAX_PROMPTS (cluster/settings.py): prompts in one completions body, a static ceiling checked before any
# per-prompt work (the server's own limit, `max_prompts_per_request`, is lower and checked before tokenization).


def _unset(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ""


def _none_or(*neutral: Any) -> Callable[[Any], bool]:
    return lambda value: _unset(value) or value in neutral


# Known fields we do not implement: name -> "this value asks for nothing" (anything else is refused).
UNSUPPORTED_FIELDS: dict[str, Callable[[Any], bool]] = {
    "functions": _unset,
    "function_call": _none_or("none"),
    "tools": _unset,  # chat completions implement these two (ChatCompletionRequest.SUPPORTED_FIELDS)
    "tool_choice": _none_or("none"),
    "use_beam_search": _unset,
    "length_penalty": _none_or(1, 1.0),
    "early_stopping": _unset,
    "guided_decoding_backend": _unset,
    "logits_processors": _unset,
    "chat_template_kwargs": _unset,
    "mm_processor_kwargs": _unset,
    "documents": _unset,
    "audio": _unset,
    "prediction": _unset,
}


def unsupported_field(values: Mapping[str, Any], skip: frozenset[str] = frozenset()) -> str | None:
    """The first known-but-unimplemented field that asks for something, if any (`skip`: fields the
    request type at hand does implement, e.g. chat's tools)."""
    for name, neutral in UNSUPPORTED_FIELDS.items():
        if name in values and name not in skip and not neutral(values[name]):
            return name
    return None


def printable(text: str) -> str:
    """`text` with anything UTF-8 cannot carry (lone surrogates) escaped, safe for messages and logs."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _encodable(value: Any) -> bool:
    if isinstance(value, str):
        if value.isascii():
            return True
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(_encodable(k) and _encodable(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_encodable(v) for v in value)
    return True


def check_text_encodable(values: Mapping[str, Any]) -> None:
    """Raise a ValueError naming the top-level field whose text (keys included) is not valid Unicode,
    e.g. a lone surrogate sent as a JSON escape: it could not be tokenized, logged or echoed."""
    for name, value in values.items():
        if not _encodable(name) or not _encodable(value):
            raise ValueError(f"{printable(str(name))}: text is not valid Unicode (a lone surrogate?)")

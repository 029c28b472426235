"""Specs and validity checks shared by the structured-output tests (and nothing else)."""

from __future__ import annotations

import json
import re

import jsonschema

from pagedserve import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["id", "ok"],
}
REGEX = r"[a-z]{2,4}-\d{1,3}"
CHOICES = ["yes", "no", "maybe so"]
# An EBNF grammar whose language is also a Python regex (the independent check).
GRAMMAR = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
GRAMMAR_RE = r"\((?:[1-9][0-9]?)(?:\+[1-9][0-9]?)*\)"

# The random-weight test models would emit whitespace forever if JSON allowed any: keep it compact.
SPECS: dict[str, dict] = {
    "json": {"json": SCHEMA, "whitespace_pattern": ""},
    "json_object": {"json_object": True, "whitespace_pattern": ""},
    "regex": {"regex": REGEX},
    "choice": {"choice": CHOICES},
    "grammar": {"grammar": GRAMMAR},
}


def is_valid(kind: str, text: str, schema: dict | None = None) -> bool:
    """Whether `text` is in the language of the spec kind (independently of xgrammar)."""
    if kind in ("json", "json_object"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        if kind == "json_object":
            return isinstance(value, dict)
        try:
            jsonschema.validate(value, schema or SCHEMA)
        except jsonschema.ValidationError:
            return False
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(GRAMMAR_RE, text) is not None


def constrained(kind: str, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 48)
    return SamplingParams(structured_outputs=SPECS[kind], **kw)


def assert_valid_outputs(kind: str, request_output, min_stopped: int = 1) -> None:
    """Every choice that stopped is valid; a 'length' one is a prefix cut short; at least
    `min_stopped` choices stopped."""
    stopped = 0
    assert request_output.error is None, request_output.error
    for choice in request_output.outputs:
        assert choice.finish_reason in ("stop", "length"), choice.finish_reason
        if choice.finish_reason == "stop":
            stopped += 1
            assert is_valid(kind, choice.text), (kind, choice.text)
    assert stopped >= min_stopped, [(c.text, c.finish_reason) for c in request_output.outputs]

"""`StructuredOutputsParams`: what a request's output must match (vLLM's shape).

Exactly one of `json` (a JSON schema, as a dict or a JSON string), `json_object` (any JSON
object), `regex`, `choice` (one of a list of strings) or `grammar` (EBNF) is set. This module
checks only the shape and is light to import (no xgrammar): whether a schema, regex or grammar
actually parses, and is within the size limits (`limits.py`), is checked by `grammar.check_spec`
when the processor validates a request.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Bounds the per-request validation work and the size of a grammar cache entry.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024


class StructuredOutputsParams(BaseModel):
    """One output constraint; errors name the field (`structured_outputs.<field>`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, serialize_by_alias=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = Field(default=None, min_length=1, max_length=MAX_SPEC_CHARS)
    choice: list[str] | None = Field(default=None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = Field(default=None, min_length=1, max_length=MAX_SPEC_CHARS)
    # JSON only: every object schema gets additionalProperties: false (no keys beyond `properties`).
    disable_additional_properties: bool = False
    # JSON only: whitespace allowed between tokens. None: at most 16 characters of [ \n\r\t] in a row
    # (grammar.DEFAULT_MAX_WHITESPACE); "": none (compact JSON); "[...]*" any run of the listed
    # characters (a model may then emit whitespace until max_tokens); "[...]{0,N}" at most N of them.
    whitespace_pattern: str | None = None

    @field_validator("json_", mode="before")
    @classmethod
    def _check_json(cls, v: Any) -> Any:
        if isinstance(v, str):
            if len(v) > MAX_SPEC_CHARS:
                raise ValueError(f"the schema has more than {MAX_SPEC_CHARS} characters")
            try:
                parsed = json.loads(v)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the schema is not valid JSON: {exc}") from None
            if not isinstance(parsed, (dict, bool)):
                raise ValueError("the schema must be a JSON object")
        elif isinstance(v, dict) and len(json.dumps(v)) > MAX_SPEC_CHARS:
            raise ValueError(f"the schema has more than {MAX_SPEC_CHARS} characters")
        return v

    @field_validator("choice")
    @classmethod
    def _check_choice(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            if any(c == "" for c in v):
                raise ValueError("choices must be non-empty strings")
            if sum(len(c) for c in v) > MAX_SPEC_CHARS:
                raise ValueError(f"the choices have more than {MAX_SPEC_CHARS} characters in all")
        return v

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsParams:
        set_kinds = [k for k in KINDS if self._value(k) not in (None, False)]
        if len(set_kinds) != 1:
            found = ", ".join(set_kinds) if set_kinds else "none"
            raise ValueError(f"structured_outputs: exactly one of {', '.join(KINDS)} must be set (found: {found})")
        kind = set_kinds[0]
        if kind not in ("json", "json_object") and (
            self.disable_additional_properties or self.whitespace_pattern is not None
        ):
            raise ValueError(
                "structured_outputs: disable_additional_properties and whitespace_pattern apply to json only"
            )
        return self

    def _value(self, kind: str) -> Any:
        return self.json_ if kind == "json" else getattr(self, kind)

    @property
    def json(self) -> dict[str, Any] | str | None:  # type: ignore[override]
        return self.json_

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if self._value(k) not in (None, False))

    def cache_key(self) -> str:
        """A canonical string of the whole spec: equal specs compile once per engine."""
        schema = self.json_
        if isinstance(schema, str):
            schema = json.loads(schema)
        data = self.model_dump(exclude={"json_"})
        data["json"] = schema
        return json.dumps(data, sort_keys=True, ensure_ascii=False)

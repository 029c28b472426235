"""From a `StructuredOutputsParams` to an xgrammar grammar: checked up front, compiled later.

`check_spec` parses the spec without the tokenizer (cheap: no token masks are computed), so a
bad schema, regex or grammar, or one over the size limits (`limits.py`), is a ValueError naming the
field before the request is queued. `compile_spec` does the expensive, tokenizer-specific compile
(the manager runs it in a worker process).

JSON allows at most `DEFAULT_MAX_WHITESPACE` whitespace characters between two tokens unless the
request's `whitespace_pattern` says otherwise: with any run allowed, a model that prefers a newline
after `{"name"` emits newlines until max_tokens (the bundled model does at temperature 0).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from pagedserve.engine.structured_output.limits import (
    DEFAULT_LIMITS,
    GrammarLimits,
    check_grammar_size,
    check_schema_shape,
)
from pagedserve.engine.structured_output.params import StructuredOutputsParams

_FIELD = "structured_outputs"
ANY_OBJECT = '{"type": "object"}'
# Whitespace characters allowed in a row between JSON tokens by default: room for a newline and
# the indentation of pretty-printed JSON, never an endless run.
DEFAULT_MAX_WHITESPACE = 16
# "[chars]*" (any run) or "[chars]{0,N}" / "[chars]{,N}" (at most N): what xgrammar can express.
_WHITESPACE_RE = re.compile(r"\[[^\]]*\](\*|\{0?,(\d+)\})")


@dataclass(frozen=True)
class JsonOptions:
    any_whitespace: bool
    max_whitespace_cnt: int | None


def json_options(params: StructuredOutputsParams) -> JsonOptions:
    pattern = params.whitespace_pattern
    if pattern is None:
        return JsonOptions(any_whitespace=True, max_whitespace_cnt=DEFAULT_MAX_WHITESPACE)
    if pattern == "":
        return JsonOptions(any_whitespace=False, max_whitespace_cnt=None)
    match = _WHITESPACE_RE.fullmatch(pattern)
    if match is None:
        raise ValueError(
            f"{_FIELD}.whitespace_pattern: {pattern!r} is not supported; use '' (no whitespace), "
            "'[ \\n\\t]*' (any) or '[ \\n\\t]{0,N}' (at most N characters)"
        )
    limit = match.group(2)
    return JsonOptions(any_whitespace=True, max_whitespace_cnt=int(limit) if limit else None)


def schema_of(params: StructuredOutputsParams) -> str:
    """The JSON schema as a string, with additionalProperties: false forced when asked."""
    schema: Any = params.json
    if isinstance(schema, str):
        schema = json.loads(schema)
    if params.disable_additional_properties:
        schema = _close_objects(schema)
    return json.dumps(schema, ensure_ascii=False)


def _close_objects(node: Any) -> Any:
    if isinstance(node, list):
        return [_close_objects(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _close_objects(v) for k, v in node.items()}
    if out.get("type") == "object" or "properties" in out:
        out["additionalProperties"] = False
    return out


def choice_ebnf(choices: list[str]) -> str:
    """root ::= "a" | "b" ...: JSON string escapes are EBNF string escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check_spec(params: StructuredOutputsParams, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """ValueError naming the field unless the spec parses and is within `limits` (no tokenizer needed)."""
    kind = params.kind
    if kind == "json_object":  # one fixed grammar
        json_options(params)
        return
    try:
        if kind == "json":
            options = json_options(params)
            raw = params.json
            check_schema_shape(json.loads(raw) if isinstance(raw, str) else raw, limits)  # before any recursion
            schema = schema_of(params)
            grammar = xgr.Grammar.from_json_schema(
                schema, any_whitespace=options.any_whitespace, max_whitespace_cnt=options.max_whitespace_cnt,
            )
        elif kind == "regex":
            grammar = xgr.Grammar.from_regex(params.regex)
        elif kind == "choice":
            grammar = xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
        else:
            grammar = xgr.Grammar.from_ebnf(params.grammar)
        check_grammar_size(str(grammar), limits)
    except ValueError as exc:
        message = _clean(exc)
        raise ValueError(message if message.startswith(_FIELD) else f"{_FIELD}.{kind}: {message}") from None
    except Exception as exc:  # xgrammar reports parse errors as RuntimeError
        raise ValueError(f"{_FIELD}.{kind}: {_clean(exc)}") from None


def compile_spec(compiler: xgr.GrammarCompiler, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
    kind = params.kind
    if kind == "json":
        options = json_options(params)
        return compiler.compile_json_schema(
            schema_of(params), any_whitespace=options.any_whitespace,
            max_whitespace_cnt=options.max_whitespace_cnt,
        )
    if kind == "json_object":  # any JSON object (as OpenAI's json_object), not any JSON value
        options = json_options(params)
        return compiler.compile_json_schema(
            ANY_OBJECT, any_whitespace=options.any_whitespace, max_whitespace_cnt=options.max_whitespace_cnt,
            strict_mode=False,
        )
    if kind == "regex":
        return compiler.compile_regex(params.regex)
    if kind == "choice":
        return compiler.compile_grammar(choice_ebnf(params.choice))
    return compiler.compile_grammar(params.grammar)


def _clean(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(exc).strip()
    text = re.sub(r"^\[[0-9:]+\]\s+\S+:\d+:\s*", "", text)
    return text.splitlines()[0] if text else type(exc).__name__

"""How big a structured-output spec may be, measured before anything is compiled.

A grammar's compile cost is not its text's length: a 3.5 KB regex of 300 alternatives `[a-z]{i}x`
compiles for 26 s into a 190 MB grammar (on a 49k-token vocabulary), because xgrammar computes
token masks for every position of every bounded repetition of a character class. The limits here
are what can be measured cheaply, on the spec and on xgrammar's parsed (not compiled) grammar:

- `max_schema_depth`: nesting of the JSON-schema document (objects and arrays; a nested object
  schema takes two levels, `properties` and the property); converting a schema to a grammar grows
  with the cube of its depth (nested array schemas: 32 levels 22 ms, 63 levels 140 ms, 200 levels
  1 s, before any compile, and on the engine thread too).
- `max_object_properties`: properties of one object schema; optional properties compile in
  time that grows faster than their number (512: 1 s, 1000: 19 s).
- `max_alternatives`: entries of one `enum`, `anyOf`, `oneOf` or `allOf` (as `choice` is bounded).
- `max_repetition_units`: the bounded repetitions `{m,n}` of the parsed grammar, each distinct
  one (same repeated rule, same bound) counting its bound, at most `repetition_unit_cap` (the
  repetitions xgrammar unrolls; longer ones cost about as much). This applies alike to regex
  counts, EBNF counts and JSON-schema maxLength / minLength / maxItems / patterns.

Within the limits a compile still may take seconds on a large vocabulary; the manager bounds the
time (a killed worker process) and the memory of each compile.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GrammarLimits:
    max_schema_depth: int = 32
    max_object_properties: int = 256
    max_alternatives: int = 1024
    max_repetition_units: int = 2048
    repetition_unit_cap: int = 128


DEFAULT_LIMITS = GrammarLimits()

_ALTERNATIVE_KEYS = ("enum", "anyOf", "oneOf", "allOf")
# In xgrammar's printed grammar: quoted literals and character classes (skipped), and counted repeats.
_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]')
_REPEAT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)?\{(\d+), ?(-?\d+)\}")
_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= (.*)$", re.M)


def check_schema_shape(schema: Any, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """ValueError (no field prefix) when the schema document nests deeper than the limit, or one of
    its objects has too many properties, or one enum / anyOf / oneOf / allOf too many entries.
    Walks iteratively: a deep document cannot exhaust the Python stack here."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        if depth > limits.max_schema_depth:
            raise ValueError(f"the schema nests more than {limits.max_schema_depth} levels deep")
        if isinstance(node, list):
            stack.extend((item, depth + 1) for item in node)
            continue
        properties = node.get("properties")
        if isinstance(properties, dict) and len(properties) > limits.max_object_properties:
            raise ValueError(f"an object schema has {len(properties)} properties, more than the limit of "
                             f"{limits.max_object_properties}")
        for key in _ALTERNATIVE_KEYS:
            entries = node.get(key)
            if isinstance(entries, list) and len(entries) > limits.max_alternatives:
                raise ValueError(f"{key} has {len(entries)} entries, more than the limit of {limits.max_alternatives}")
        stack.extend((value, depth + 1) for value in node.values())


def repetition_units(grammar_text: str, unit_cap: int = DEFAULT_LIMITS.repetition_unit_cap) -> int:
    """The repetition units of a grammar as xgrammar prints it (`rule ::= body` per line, counted
    repeats as `name{m, n}`, n = -1 unbounded): per distinct (repeated rule's body, bound), the bound
    capped at `unit_cap`. An unbounded repeat counts its lower bound (`a{3,}` unrolls three)."""
    bodies = {name: body for name, body in _RULE.findall(grammar_text)}
    seen: set[tuple[str, int]] = set()
    units = 0
    for _, body in _RULE.findall(grammar_text):
        for name, low, high in _REPEAT.findall(_LITERAL.sub('""', body)):
            bound = int(high) if int(high) >= 0 else int(low)
            key = (bodies.get(name, name), bound)
            if key not in seen:
                seen.add(key)
                units += min(bound, unit_cap)
    return units


def check_grammar_size(grammar_text: str, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """ValueError (no field prefix) when the parsed grammar's repetition units exceed the limit."""
    units = repetition_units(grammar_text, limits.repetition_unit_cap)
    if units > limits.max_repetition_units:
        raise ValueError(
            f"the grammar's bounded repetitions add up to {units} units, more than the limit of "
            f"{limits.max_repetition_units} (each distinct {{m,n}} repeat, maxLength, minLength or maxItems counts "
            f"its bound, at most {limits.repetition_unit_cap}); use fewer or smaller counts, or unbounded ones"
        )

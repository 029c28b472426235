"""The tool-call parsers by name (`--tool-call-parser`), and what a parse returns.

Each parser is a `ToolCallFormat` (`stream.py`) run two ways: `extract(text)` parses a whole output,
`stream()` returns a `ToolCallStream` for an output that arrives in pieces. The formats:

- `hermes`: Hermes 2 Pro / Qwen 2.5+ / Qwen 3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one call per block, text before, between and after the blocks is content.
- `llama3_json`: Llama 3.1+ JSON calls: `{"name": ..., "parameters": {...}}` at the start of the output,
  or after `<|python_tag|>` (a special token: seen only with `skip_special_tokens=False`); several calls
  joined by `;`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`; call ids are 9 letters and digits,
  as Mistral's chat templates require.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field

from pagedserve.engine.tool_parsers.stream import DeltaMessage, ToolCallDelta, ToolCallFormat, ToolCallStream

_ALNUM = string.ascii_letters + string.digits


def new_call_id() -> str:
    """OpenAI-style call id: `call_` and 24 hex digits."""
    return f"call_{secrets.token_hex(12)}"


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass
class ToolCall:
    """One complete call: `arguments` is the JSON text of the arguments object, as the model wrote it."""

    id: str
    name: str
    arguments: str


@dataclass
class ExtractedToolCalls:
    """A whole output parsed: the text that was not a call (None when there is none) and the calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ToolParser:
    """Parses one model family's tool calls out of generated text (see the module docstring)."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.format = fmt

    @property
    def name(self) -> str:
        return self.format.name

    @property
    def skip_special_tokens(self) -> bool:
        """Whether the call markers survive detokenization with special tokens skipped: when False, a
        request parsed by this parser must be detokenized with `skip_special_tokens=False`."""
        return self.format.skip_special_tokens

    def stream(self, eager: bool = True, max_calls: int | None = None) -> ToolCallStream:
        """A parser for one output arriving in pieces: `feed(delta_text)`, then `finish()`. `max_calls`:
        calls past this many are dropped (OpenAI's parallel_tool_calls=False keeps the first)."""
        return ToolCallStream(self.format, new_call_id, eager=eager, max_calls=max_calls)

    def extract(self, text: str, max_calls: int | None = None) -> ExtractedToolCalls:
        """Parse a whole output. A call that is not well-formed stays in the content, as text."""
        stream = self.stream(eager=False, max_calls=max_calls)
        return collect_deltas([stream.feed(text), stream.finish()])


def collect_deltas(deltas: list[DeltaMessage]) -> ExtractedToolCalls:
    """Join streamed deltas into whole calls and content (the non-streamed answer they add up to)."""
    content = "".join(d.content for d in deltas)
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        for d in delta.tool_calls:
            call = calls.get(d.index)
            if call is None:
                call = calls[d.index] = ToolCall(d.id or "", d.name or "", "")
            call.arguments += d.arguments
    return ExtractedToolCalls(content or None, [calls[i] for i in sorted(calls)])


FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat("hermes", start_markers=("<tool_call>",), end_marker="</tool_call>", body="object"),
    # <|python_tag|> is a special token: it reaches the text only when the request keeps special tokens.
    "llama3_json": ToolCallFormat("llama3_json", start_markers=("<|python_tag|>",), body="sequence",
                                  bare_start="{"),
    "mistral": ToolCallFormat("mistral", start_markers=("[TOOL_CALLS]",), body="array", skip_special_tokens=False,
                              new_id=mistral_call_id),
}
TOOL_PARSERS = tuple(FORMATS)
# Output constrained by `tool_choice` "required" or a named function (`tool_spec.forced_call_schema`):
# the whole output is one call object, or a JSON array of them when parallel calls are allowed.
FORCED_OBJECT = ToolCallFormat("forced_object", body="object", bare_start="{")
FORCED_ARRAY = ToolCallFormat("forced_array", body="array", bare_start="[")


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as `name` (one of `TOOL_PARSERS`); ValueError naming the choices otherwise."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"tool_call_parser: unknown parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}")
    return ToolParser(fmt)


def forced_call_parser(parallel: bool) -> ToolParser:
    """The parser of output constrained to a call (or, with `parallel`, an array of calls)."""
    return ToolParser(FORCED_ARRAY if parallel else FORCED_OBJECT)


__all__ = ["DeltaMessage", "ToolCallDelta", "ToolCall", "ExtractedToolCalls", "ToolParser", "get_tool_parser",
           "forced_call_parser", "TOOL_PARSERS"]

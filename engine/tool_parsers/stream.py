"""`ToolCallStream`: one choice's text, fed as it is generated, split into content and tool calls.

A format (`formats.py`) says how a model marks its calls: a marker that opens a call region anywhere
in the text (`<tool_call>`, `[TOOL_CALLS]`), or a body that may open the output itself (Llama 3's `{`),
an optional marker that closes the region, and the region's body: one call object, a JSON array of
them, or objects separated by `;`. The stream

- passes text through as content, holding back what might be the start of a marker (a marker split
  across chunks is still found) and trailing whitespace: content is stripped (whitespace around the
  calls is no content);
- scans a call's JSON as it arrives (`json_scan.py`): its header (index, id, name) goes out once the
  name is complete and the arguments object has begun, then the arguments in fragments as they grow;
- returns a call that turns out malformed (bad JSON, no name, text cut off) as content, from its
  marker on, when nothing of it was sent yet. A streamed call cannot be withdrawn: one that breaks
  after its header went out ends there, and the text from the break on is content.

`eager=False` (the whole-output parse, `ToolParser.extract`) sends each call only once it is complete,
so a malformed call is always content; for output that is not malformed the two modes send the same
calls and content, whatever the chunking.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from pagedserve.engine.tool_parsers.json_scan import CallObjectScanner, Scan

_WS = " \t\n\r"


@dataclass(frozen=True)
class ToolCallFormat:
    """How one model family writes tool calls (see the module docstring)."""

    name: str
    start_markers: tuple[str, ...] = ()
    end_marker: str | None = None
    body: str = "object"  # "object" | "array" (a single object also accepted) | "sequence" (objects joined by ';')
    bare_start: str = ""  # characters that open a region with no marker at the very start of the output
    skip_special_tokens: bool = True  # False when a marker is a special token (it must reach the text)
    new_id: Callable[[], str] | None = None  # the ids of this format's calls (default: call_ + 24 hex digits)


@dataclass
class ToolCallDelta:
    """One OpenAI tool-call delta: the header (id, name) first, then argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class DeltaMessage:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


class _Mode(Enum):
    TEXT = 1
    BODY = 2  # between calls of a region, expecting the next call or the body's end
    CALL = 3
    AFTER_BODY = 4  # the body ended; matching the end marker


@dataclass
class _Call:
    start: int  # offset of its '{'
    scanner: CallObjectScanner = field(default_factory=CallObjectScanner)
    index: int | None = None  # set when its header is sent
    sent_args: int = 0  # characters of the arguments sent


class ToolCallStream:
    """Feed text with `feed`, end with `finish`; each returns what to send (a `DeltaMessage`)."""

    def __init__(self, fmt: ToolCallFormat, new_id: Callable[[], str], eager: bool = True,
                 max_calls: int | None = None) -> None:
        self.format = fmt
        self.eager = eager
        self.max_calls = max_calls  # calls past this many are parsed but dropped (parallel_tool_calls=False)
        self._new_id = fmt.new_id or new_id
        self._text = ""
        self._pos = 0  # next offset to scan
        self._mode = _Mode.TEXT
        self._content_from = 0  # start of the content not yet sent (or held)
        self._ws_hold = ""  # trailing whitespace of the content, sent only if more content follows
        self._sent_content = False  # content never starts with whitespace
        self._region_start = 0
        self._body_kind = "object"
        self._expect_call = True  # BODY: a call must come next (after '[' or ',' or ';')
        self._call: _Call | None = None
        self._calls_in_region = 0
        self._after_start = 0  # AFTER_BODY: where the end marker (or what replaces it) begins
        self._at_output_start = True
        self.num_calls = 0
        self._out = DeltaMessage()

    # ------------------------------------------------------------------ public

    def feed(self, text: str) -> DeltaMessage:
        self._text += text
        while self._pos < len(self._text):
            self._step(self._text[self._pos])
        if self._mode is _Mode.TEXT:
            self._send_content(self._held_marker_start())
        elif self._mode is _Mode.CALL and self.eager:
            self._send_args(self._call, final=False)  # type: ignore[arg-type]
        return self._take()

    def finish(self) -> DeltaMessage:
        """The output ended: whatever was held back is decided."""
        if self._mode is _Mode.CALL or (self._mode is _Mode.BODY and self._expect_call and self._calls_in_region == 0):
            self._malformed(len(self._text))
        if self._mode is _Mode.AFTER_BODY:  # no end marker: the region still counts; a partial one is text
            self._content_from = self._after_start
        elif self._mode is _Mode.BODY:
            self._content_from = len(self._text)
        self._send_content(len(self._text))
        self._ws_hold = ""
        return self._take()

    # ------------------------------------------------------------------ scanning

    def _step(self, ch: str) -> None:
        mode = self._mode
        if mode is _Mode.TEXT:
            self._text_char(ch)
        elif mode is _Mode.CALL:
            self._call_char(ch)
        elif mode is _Mode.BODY:
            self._body_char(ch)
        else:
            self._after_body_char(ch)

    def _text_char(self, ch: str) -> None:
        pos = self._pos
        if self._at_output_start:
            if ch in _WS:
                self._pos += 1
                return
            self._at_output_start = False
            if ch in self.format.bare_start:
                self._open_region(pos, pos)
                return
        for marker in self.format.start_markers:
            start = pos + 1 - len(marker)
            if start >= self._content_from and self._text.startswith(marker, start):
                self._open_region(start, pos + 1)
                return
        self._pos += 1

    def _open_region(self, start: int, body_at: int) -> None:
        self._send_content(start)
        self._region_start = start
        self._calls_in_region = 0
        self._mode = _Mode.BODY
        self._body_kind = self.format.body
        self._expect_call = True
        self._pos = body_at

    def _body_char(self, ch: str) -> None:
        pos = self._pos
        if ch in _WS:
            self._pos += 1
            return
        kind = self._body_kind
        if kind == "array" and self._calls_in_region == 0 and self._expect_call and ch == "[":
            self._body_kind = "array_open"
            self._pos += 1
            return
        if self._expect_call:
            if ch == "{":
                self._call = _Call(pos)
                self._mode = _Mode.CALL
                return
            if kind == "array_open" and ch == "]" and self._calls_in_region == 0:
                self._end_body(pos + 1)
                return
            self._malformed(pos)
            return
        if kind == "array_open":
            if ch == ",":
                self._expect_call = True
                self._pos += 1
            elif ch == "]":
                self._end_body(pos + 1)
            else:
                self._malformed(pos)
        elif kind == "sequence" and ch == ";":
            self._expect_call = True
            self._pos += 1
        else:  # one object (or a sequence) ended: what follows is the end marker or content
            self._end_body(pos)

    def _call_char(self, ch: str) -> None:
        call = self._call
        assert call is not None
        pos = self._pos
        result = call.scanner.feed(ch, pos)
        if result is Scan.INVALID:
            self._malformed(pos)
            return
        self._pos += 1
        if self.eager and call.index is None:
            self._maybe_send_header(call)
        if result is Scan.DONE:
            scanner = call.scanner
            if scanner.name is None:
                self._malformed(pos + 1)
                return
            self._maybe_send_header(call, complete=True)
            self._send_args(call, final=True)
            self._call = None
            self._calls_in_region += 1
            self._mode = _Mode.BODY
            self._expect_call = False
            if self._body_kind == "object":
                self._end_body(pos + 1)

    def _end_body(self, end: int) -> None:
        self._pos = end
        self._content_from = end
        self._after_start = end
        if self.format.end_marker is None:
            self._mode = _Mode.TEXT
        else:
            self._mode = _Mode.AFTER_BODY

    def _after_body_char(self, ch: str) -> None:
        marker = self.format.end_marker
        assert marker is not None
        seen = self._text[self._after_start:self._pos + 1].lstrip(_WS)
        if marker.startswith(seen):
            self._pos += 1
            if seen == marker:
                self._mode = _Mode.TEXT
                self._content_from = self._pos
            return
        self._mode = _Mode.TEXT  # no end marker: the text after the body is content
        self._pos = self._after_start
        self._content_from = self._after_start

    def _malformed(self, pos: int) -> None:
        """The call (or body) cannot go on at `pos`: what of it was not sent is content."""
        call = self._call
        if call is not None and call.index is not None:
            self._send_args(call, final=False, upto=pos)  # its header went out: the call ends here
            self._content_from = pos
        elif call is not None and self._calls_in_region:
            self._content_from = call.start
        elif self._calls_in_region == 0:
            self._content_from = self._region_start
        else:
            self._content_from = pos
        self._call = None
        self._mode = _Mode.TEXT
        self._pos = max(pos, self._content_from)
        if self._pos == self._region_start:
            self._pos += 1  # a marker that opened nothing is content; scanning goes on after its first character

    # ------------------------------------------------------------------ sending

    def _held_marker_start(self) -> int:
        """Where the text that might begin a start marker (at the very end) starts."""
        text, end = self._text, len(self._text)
        if self._at_output_start:
            return self._content_from
        held = end
        for marker in self.format.start_markers:
            for k in range(min(len(marker) - 1, end - self._content_from), 0, -1):
                if text.endswith(marker[:k]):
                    held = min(held, end - k)
                    break
        return held

    def _send_content(self, end: int) -> None:
        if end <= self._content_from:
            return
        chunk = self._ws_hold + self._text[self._content_from:end]
        self._content_from = end
        if not self._sent_content:
            chunk = chunk.lstrip(_WS)
        kept = chunk.rstrip(_WS)
        self._sent_content = self._sent_content or bool(kept)
        self._ws_hold = chunk[len(kept):]
        self._out.content += kept

    def _maybe_send_header(self, call: _Call, complete: bool = False) -> None:
        scanner = call.scanner
        if call.index is not None or scanner.name is None:
            return
        if not complete and (not self.eager or scanner.args_start is None):
            return
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            call.index = -1  # dropped: neither a call nor content
            return
        call.index = self.num_calls
        self.num_calls += 1
        self._out.tool_calls.append(ToolCallDelta(call.index, id=self._new_id(), name=scanner.name))

    def _send_args(self, call: _Call, final: bool, upto: int | None = None) -> None:
        scanner = call.scanner
        if call.index is None or call.index < 0:
            return
        if scanner.args_start is None:
            text = "{}" if final else ""
        else:
            end = scanner.args_end if scanner.args_end is not None else (upto or len(self._text))
            text = self._text[scanner.args_start:end]
            if scanner.args_end is None:
                text = text.rstrip(_WS)
        fragment = text[call.sent_args:]
        if not fragment:
            return
        call.sent_args = len(text)
        last = self._out.tool_calls[-1] if self._out.tool_calls else None
        if last is not None and last.index == call.index:
            last.arguments += fragment
        else:
            self._out.tool_calls.append(ToolCallDelta(call.index, arguments=fragment))

    def _take(self) -> DeltaMessage:
        out, self._out = self._out, DeltaMessage()
        return out

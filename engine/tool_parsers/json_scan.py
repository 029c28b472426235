"""An incremental JSON scanner for one tool-call object, fed a character at a time.

A streamed tool call is parsed as its text arrives: the scanner validates the JSON as a prefix (a
bad character is known at once, not when the call ends) and reports where the values of the
object's own keys (depth 1) begin and end, so that the call's `name` can be read as soon as it is
complete and its `arguments` forwarded as they grow. Positions are absolute offsets into the text the
owner keeps; the scanner holds no text itself except the key or name string being read.
"""

from __future__ import annotations

import json
from enum import Enum

_WS = " \t\n\r"
_LITERALS = {"t": "true", "f": "false", "n": "null"}
# Number states: terminal ones may end the number.
_N_TERMINAL = frozenset({"zero", "int", "frac", "exp"})


class Scan(Enum):
    MORE = "more"  # the character was consumed; the value goes on
    DONE = "done"  # the character completed the value
    DONE_BEFORE = "done_before"  # the value had ended before this character (a number), which is not consumed
    INVALID = "invalid"  # the character cannot continue this JSON value


class _State(Enum):
    VALUE = 1
    OBJ_KEY_OR_END = 2
    OBJ_KEY = 3
    OBJ_COLON = 4
    OBJ_COMMA_OR_END = 5
    ARR_VALUE_OR_END = 6
    ARR_COMMA_OR_END = 7
    STRING = 8
    LITERAL = 9
    NUMBER = 10
    END = 11


class CallObjectScanner:
    """Scans one JSON object `{"name": ..., "arguments": {...}, ...}` (keys in any order).

    After each `feed`, `name` is the decoded name once its string is complete, `args_start` the offset of
    the arguments value ("arguments", or Llama's "parameters") once it began and `args_end` once it ended.
    A call is malformed (INVALID) when the JSON is, when its name is not a string or its arguments are not
    an object, or when a key repeats."""

    ARGUMENT_KEYS = ("arguments", "parameters")

    def __init__(self) -> None:
        self._stack: list[str] = []
        self._state = _State.VALUE
        self._after_string = _State.VALUE  # what a finished string returns to
        self._string_is_key = False
        self._escape = 0  # 1: after a backslash; 2..5: hex digits of \\uXXXX still expected, plus one
        self._literal = ""
        self._literal_at = 0
        self._number = ""
        self._chars: list[str] = []  # the depth-1 key or the name string being read
        self._reading = False
        self._key: str | None = None
        self._keys: set[str] = set()
        self._value_key: str | None = None  # the key whose depth-1 value is open
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None

    @property
    def done(self) -> bool:
        return self._state is _State.END

    def feed(self, ch: str, pos: int) -> Scan:
        """Consume the character at absolute offset `pos`."""
        state = self._state
        if state is _State.STRING:
            return self._string_char(ch, pos)
        if state is _State.LITERAL:
            expected = _LITERALS[self._literal[0]]
            self._literal += ch
            if not expected.startswith(self._literal):
                return Scan.INVALID
            return self._value_done(pos + 1) if self._literal == expected else Scan.MORE
        if state is _State.NUMBER:
            step = _number_step(self._number, ch)
            if step is not None:
                self._number = step
                return Scan.MORE
            if self._number not in _N_TERMINAL:
                return Scan.INVALID
            result = self._value_done(pos)
            if result is Scan.INVALID:
                return result
            if self._state is _State.END:
                return Scan.DONE_BEFORE
            return self.feed(ch, pos)  # the delimiter belongs to the enclosing container
        if ch in _WS:
            return Scan.INVALID if state is _State.END else Scan.MORE
        if state is _State.VALUE or state is _State.ARR_VALUE_OR_END:
            if state is _State.ARR_VALUE_OR_END and ch == "]":
                return self._close(pos)
            return self._value_start(ch, pos)
        if state is _State.OBJ_KEY_OR_END or state is _State.OBJ_KEY:
            if ch == "}" and state is _State.OBJ_KEY_OR_END:
                return self._close(pos)
            if ch != '"':
                return Scan.INVALID
            self._begin_string(is_key=True, read=len(self._stack) == 1)
            return Scan.MORE
        if state is _State.OBJ_COLON:
            if ch != ":":
                return Scan.INVALID
            self._state = _State.VALUE
            return Scan.MORE
        if state is _State.OBJ_COMMA_OR_END or state is _State.ARR_COMMA_OR_END:
            closer = "}" if state is _State.OBJ_COMMA_OR_END else "]"
            if ch == closer:
                return self._close(pos)
            if ch != ",":
                return Scan.INVALID
            self._state = _State.OBJ_KEY if closer == "}" else _State.VALUE
            return Scan.MORE
        return Scan.INVALID  # END: nothing may follow the object

    # ------------------------------------------------------------------ values

    def _value_start(self, ch: str, pos: int) -> Scan:
        if not self._stack:  # the call itself must be an object
            if ch != "{":
                return Scan.INVALID
        elif len(self._stack) == 1:
            key = self._key
            if key in self.ARGUMENT_KEYS:
                if ch != "{" or self.args_start is not None:
                    return Scan.INVALID
                self.args_start = pos
            elif key == "name" and ch != '"':
                return Scan.INVALID
            self._value_key = key
        if ch == "{":
            self._stack.append("{")
            self._state = _State.OBJ_KEY_OR_END
        elif ch == "[":
            self._stack.append("[")
            self._state = _State.ARR_VALUE_OR_END
        elif ch == '"':
            self._begin_string(is_key=False, read=len(self._stack) == 1 and self._value_key == "name")
        elif ch in _LITERALS:
            self._literal = ch
            self._state = _State.LITERAL
        else:
            step = _number_step("", ch)
            if step is None:
                return Scan.INVALID
            self._number = step
            self._state = _State.NUMBER
        return Scan.MORE

    def _close(self, pos: int) -> Scan:
        self._stack.pop()
        return self._value_done(pos + 1)

    def _value_done(self, end: int) -> Scan:
        """A value ended just before offset `end`."""
        if not self._stack:
            self._state = _State.END
            return Scan.DONE
        if len(self._stack) == 1 and self._value_key is not None:
            if self._value_key in self.ARGUMENT_KEYS:
                self.args_end = end
            self._value_key = None
        self._state = _State.OBJ_COMMA_OR_END if self._stack[-1] == "{" else _State.ARR_COMMA_OR_END
        return Scan.MORE

    # ------------------------------------------------------------------ strings

    def _begin_string(self, is_key: bool, read: bool) -> None:
        self._state = _State.STRING
        self._string_is_key = is_key
        self._reading = read
        self._chars = ['"'] if read else []

    def _string_char(self, ch: str, pos: int) -> Scan:
        if self._reading:
            self._chars.append(ch)
        if self._escape == 1:
            if ch == "u":
                self._escape = 5
            elif ch in '"\\/bfnrt':
                self._escape = 0
            else:
                return Scan.INVALID
            return Scan.MORE
        if self._escape > 1:
            if ch not in "0123456789abcdefABCDEF":
                return Scan.INVALID
            self._escape = self._escape - 1 if self._escape > 2 else 0
            return Scan.MORE
        if ch == "\\":
            self._escape = 1
            return Scan.MORE
        if ch < " ":  # control characters must be escaped
            return Scan.INVALID
        if ch != '"':
            return Scan.MORE
        text = "".join(self._chars) if self._reading else None
        self._chars = []
        if self._string_is_key:
            if text is not None:
                self._key = json.loads(text)
                if self._key in self._keys or (self._key in self.ARGUMENT_KEYS and self.args_start is not None):
                    return Scan.INVALID
                self._keys.add(self._key)
            self._state = _State.OBJ_COLON
            return Scan.MORE
        if text is not None:
            self.name = json.loads(text)
        return self._value_done(pos + 1)


def _number_step(state: str, ch: str) -> str | None:
    """The number state after `ch` (JSON's grammar: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?), or None."""
    digit = "0" <= ch <= "9"
    if state == "":
        return "sign" if ch == "-" else ("zero" if ch == "0" else ("int" if digit else None))
    if state == "sign":
        return "zero" if ch == "0" else ("int" if digit else None)
    if state in ("zero", "int"):
        if ch == ".":
            return "dot"
        if ch in "eE":
            return "e"
        return "int" if digit and state == "int" else None
    if state in ("dot", "frac"):
        if digit:
            return "frac"
        return "e" if ch in "eE" and state == "frac" else None
    if state == "e":
        return "esign" if ch in "+-" else ("exp" if digit else None)
    if state in ("esign", "exp"):
        return "exp" if digit else None
    return None

"""Tool definitions (OpenAI's function tools), `tool_choice`, and the JSON schema that forces a call.

`parse_tools` validates a request's `tools` (errors name the field: `tools[2].function.name: ...`);
`tools_for_template` is what the chat template gets (`apply_chat_template(..., tools=...)`), and
`messages_for_template` hands the template a conversation's earlier calls with their `arguments` as
objects (templates such as Llama 3's and Qwen's write them with `tojson`). `forced_call_schema` is the
structured-output schema for `tool_choice` "required" or a named function: one call object
`{"name": <one of the names>, "arguments": <that function's parameters schema>}`, or, when parallel
calls are allowed, an array of at least one of them (parsed by `parsers.forced_call_parser`).
"""

from __future__ import annotations

import copy
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# Whitespace a forced call may have between two JSON tokens (`StructuredOutputsParams.whitespace_pattern`):
# one, as models write a call on one line; more only lets a weak model pad the call until max_tokens.
FORCED_CALL_WHITESPACE = "[ ]{0,1}"
# OpenAI's limits: a function name is 1 to 64 of [a-zA-Z0-9_-]; at most 128 tools per request.
MAX_TOOLS = 128
_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDefinition

    @property
    def parameters(self) -> dict[str, Any]:
        return self.function.parameters if self.function.parameters is not None else EMPTY_PARAMETERS


def _where(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def parse_tools(raw: Any, field: str = "tools") -> list[ToolDefinition]:
    """Validated tool definitions; ValueError naming the field (`tools[i].function.name: ...`)."""
    if not isinstance(raw, list):
        raise ValueError(f"{field}: must be a list of tools")
    if len(raw) > MAX_TOOLS:
        raise ValueError(f"{field}: at most {MAX_TOOLS} tools are allowed, got {len(raw)}")
    tools: list[ToolDefinition] = []
    for i, item in enumerate(raw):
        try:
            tools.append(ToolDefinition.model_validate(item))
        except ValidationError as exc:
            error = exc.errors()[0]
            message = str(error.get("msg", "")).removeprefix("Value error, ")
            if error.get("type") == "string_pattern_mismatch":
                message = "a function name is 1 to 64 letters, digits, '_' or '-'"
            raise ValueError(f"{field}[{i}]{_where(tuple(error.get('loc', ())))}: {message}") from None
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ValueError(f"{field}[{i}].function.name: {name!r} is defined twice")
    return tools


def check_tool_schemas(tools: list[ToolDefinition], field: str = "tools") -> None:
    """ValueError naming the tool unless every parameters schema compiles to a grammar (loads xgrammar)."""
    from pagedserve.engine.structured_output.grammar import check_spec
    from pagedserve.engine.structured_output.params import StructuredOutputsParams

    for i, tool in enumerate(tools):
        where = f"{field}[{i}].function.parameters"
        try:
            check_spec(StructuredOutputsParams(json=tool.parameters))
        except ValidationError as exc:
            raise ValueError(f"{where}: {str(exc.errors()[0].get('msg', '')).removeprefix('Value error, ')}") from None
        except ValueError as exc:
            message = str(exc).removeprefix("structured_outputs.json: ")
            raise ValueError(f"{where}: {message}") from None


def named_choice(tool_choice: Any, tools: list[ToolDefinition], field: str = "tool_choice") -> str | None:
    """The function a `{"type": "function", "function": {"name": ...}}` choice names (None for a string
    choice); ValueError when the choice is malformed or names no tool of the request."""
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ValueError(f"{field}: must be 'none', 'auto', 'required' or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice[:64]!r}")
        return None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ValueError(f"{field}: a named tool choice is {{'type': 'function', 'function': {{'name': ...}}}}")
    if name not in {t.function.name for t in tools}:
        raise ValueError(f"{field}: function {name[:64]!r} is not among the request's tools")
    return name


def _call_schema(tool: ToolDefinition) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_call_schema(tools: list[ToolDefinition], name: str | None, parallel: bool) -> dict[str, Any]:
    """The JSON schema of output that is a call of `name` (or of any of `tools` when None), or an array
    of at least one such call when `parallel`."""
    chosen = [t for t in tools if name is None or t.function.name == name]
    if not chosen:
        raise ValueError("tool_choice: no tool to call")
    schemas = [_call_schema(t) for t in chosen]
    call = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {"type": "array", "items": call, "minItems": 1} if parallel else call


def tools_for_template(tools: list[ToolDefinition]) -> list[dict[str, Any]]:
    """The tools as the chat template gets them (OpenAI's shape, unset fields left out)."""
    return [t.model_dump(exclude_none=True) for t in tools]


def messages_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with each earlier call's `function.arguments` (a JSON string on the wire) as an
    object, as chat templates expect; arguments that are not a JSON object are left as they are."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            message = copy.deepcopy(message)
            for call in message["tool_calls"]:
                function = call.get("function") if isinstance(call, dict) else None
                arguments = function.get("arguments") if isinstance(function, dict) else None
                if isinstance(arguments, str):
                    try:
                        parsed = json.loads(arguments)
                    except json.JSONDecodeError:
                        continue
                    if isinstance(parsed, dict):
                        function["arguments"] = parsed
        out.append(message)
    return out

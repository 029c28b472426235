"""Tool calling on `POST /v1/chat/completions`: what a request's tools ask of the server, and its
choices' text turned into `tool_calls` (whole, or as OpenAI's streamed tool-call deltas).

- tool_choice "none": the tools are rendered by the chat template (as vLLM does), the answer is text.
- "auto" (the default when a request has tools): needs `--enable-auto-tool-choice`; the model's text
  is parsed by `--tool-call-parser`; a malformed call stays text.
- "required" or a named function: the output is constrained to the call's JSON schema (the request's
  structured output, `ChatCompletionRequest.forced_tool_schema`) and parsed as such.

The request shape is checked by `requests.ChatCompletionRequest`; here, what depends on the server and
the tools' schemas (compiled by xgrammar: `check_schemas` runs in the thread pool).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.cluster.serving.errors import APIError
from pagedserve.cluster.serving.requests import ChatCompletionRequest
from pagedserve.cluster.serving.responses import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from pagedserve.cluster.settings import ServeArgs
from pagedserve.engine.tool_parsers import DeltaMessage, ToolParser, forced_call_parser, get_tool_parser
from pagedserve.engine.tool_parsers.stream import ToolCallStream
from pagedserve.engine.tool_parsers.tool_spec import ToolDefinition, check_tool_schemas, tools_for_template

AUTO_NEEDS_FLAGS = ('tool_choice: "auto" tool choice (the default when a request has tools) requires the server to '
                    'be started with --enable-auto-tool-choice and --tool-call-parser; pass tool_choice "required", '
                    '"none" or a named function instead')


@dataclass
class ToolPlan:
    """How one request's output is read: `parser` None means plain text (no tools, or tool_choice "none")."""

    tools: list[ToolDefinition]
    parser: ToolParser | None
    max_calls: int | None  # 1 when parallel_tool_calls is false (auto: later calls are dropped)

    @property
    def template_tools(self) -> list[dict] | None:
        return tools_for_template(self.tools) if self.tools else None

    def stream(self, eager: bool = True) -> ToolCallStream | None:
        return None if self.parser is None else self.parser.stream(eager=eager, max_calls=self.max_calls)


def plan_tools(request: ChatCompletionRequest, args: ServeArgs) -> ToolPlan:
    """The request's tool plan; APIError (400) for auto tool choice on a server without a parser."""
    tools = request.tool_definitions()
    choice = request.effective_tool_choice()
    max_calls = None if request.parallel_tool_calls else 1
    if choice == "none":
        return ToolPlan(tools, None, max_calls)
    if choice == "auto":
        if not args.enable_auto_tool_choice or args.tool_call_parser is None:
            raise APIError(400, AUTO_NEEDS_FLAGS, param="tool_choice")
        return ToolPlan(tools, get_tool_parser(args.tool_call_parser), max_calls)
    return ToolPlan(tools, forced_call_parser(request.parallel_tool_calls), None)


def check_schemas(plan: ToolPlan) -> None:
    """Every tool's parameters schema compiles (xgrammar; run it off the event loop); 400 naming the tool."""
    try:
        check_tool_schemas(plan.tools)
    except ValueError as exc:
        raise APIError(400, str(exc), param="tools") from None


def adjust_sampling_params(plan: ToolPlan, params: dict) -> dict:
    """A parser whose call markers are special tokens needs them in the text."""
    if plan.parser is not None and not plan.parser.skip_special_tokens:
        params["skip_special_tokens"] = False
    return params


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's "tool_calls" for an output that ended on its own with calls; a cut-off one keeps "length"."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def whole_message(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool_calls) of a finished choice's text."""
    if plan.parser is None:
        return text, []
    parsed = plan.parser.extract(text, max_calls=plan.max_calls)
    calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed.tool_calls]
    return parsed.content, calls


def delta_tool_calls(delta: DeltaMessage) -> list[DeltaToolCall] | None:
    """The OpenAI tool-call deltas of one parsed piece: the header (id, type, name, arguments so far) first."""
    if not delta.tool_calls:
        return None
    out = []
    for d in delta.tool_calls:
        if d.id is not None:
            out.append(DeltaToolCall(index=d.index, id=d.id, type="function",
                                     function=DeltaFunctionCall(name=d.name, arguments=d.arguments)))
        else:
            out.append(DeltaToolCall(index=d.index, function=DeltaFunctionCall(arguments=d.arguments)))
    return out

"""Tool calling in the engine: the parsers that find tool calls in generated text (`parsers.py`, by the
name `--tool-call-parser` takes; `stream.py` for output that arrives in pieces; `json_scan.py`, the
incremental JSON scanner under them) and the tool definitions with the JSON schema that forces a call
(`tool_spec.py`). Usable offline:

    from pagedserve.engine.tool_parsers import get_tool_parser
    parsed = get_tool_parser("hermes").extract(output.outputs[0].text)
    parsed.content, parsed.tool_calls  # text that was not a call; [ToolCall(id, name, arguments), ...]
"""

from pagedserve.engine.tool_parsers.parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    collect_deltas,
    forced_call_parser,
    get_tool_parser,
)
from pagedserve.engine.tool_parsers.stream import DeltaMessage, ToolCallDelta, ToolCallStream

__all__ = ["TOOL_PARSERS", "DeltaMessage", "ExtractedToolCalls", "ToolCall", "ToolCallDelta", "ToolCallStream",
           "ToolParser", "collect_deltas", "forced_call_parser", "get_tool_parser"]

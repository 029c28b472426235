"""Chat messages as a request carries them: text (or text parts), the calls an assistant message made
(`tool_calls`), and a tool's result (`role: "tool"` with its `tool_call_id`), and each as the chat
template gets it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCallParam(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str


class ToolCallParam(BaseModel):
    """A call an earlier assistant message made (OpenAI's shape)."""

    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessageParam(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant messages
    tool_call_id: str | None = None  # role "tool": the call this is the result of

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                kind = str(part.type)[:64]
                raise ValueError(f"messages: content parts of type {kind!r} are not supported (text only)")
            parts.append(part.text)
        return "".join(parts)

    def for_template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

"""The shapes parsers hand back to the chat completions route, as msgspec Structs.

They mirror OpenAI's chat API, so the route can put them into responses unchanged. Stream deltas
omit unset fields: a chunk carries only what changed, which is what OpenAI's clients expect.
"""

from __future__ import annotations

import secrets

import msgspec


def new_tool_call_id() -> str:
    """A fresh tool call id in OpenAI's shape: "call_" and 24 random hex characters."""
    return "call_" + secrets.token_hex(12)


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # a JSON string, as OpenAI's API has it (clients json.loads it themselves)


class ToolCall(msgspec.Struct, kw_only=True):
    # No omit_defaults: OpenAI's clients expect "type" in every complete tool call.
    id: str
    type: str = "function"
    function: FunctionCall


class DeltaFunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int  # which tool call of this choice the delta belongs to: 0, 1, ...
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ExtractedToolCalls(msgspec.Struct, kw_only=True):
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None  # the text outside the tool calls; None when there is none

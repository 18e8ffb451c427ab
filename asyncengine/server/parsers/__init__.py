"""Tool-call and reasoning parsers for the chat completions route, and their registries."""

from __future__ import annotations

from asyncengine.server.parsers.reasoning_parsers import (
    ReasoningParser,
    ReasoningParserManager,
    ThinkReasoningParser,
)
from asyncengine.server.parsers.tool_parsers import JsonTagsToolParser, ToolParser, ToolParserManager
from asyncengine.server.parsers.types import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    FunctionCall,
    ToolCall,
    new_tool_call_id,
)

__all__ = [
    "DeltaFunctionCall",
    "DeltaMessage",
    "DeltaToolCall",
    "ExtractedToolCalls",
    "FunctionCall",
    "JsonTagsToolParser",
    "ReasoningParser",
    "ReasoningParserManager",
    "ThinkReasoningParser",
    "ToolCall",
    "ToolParser",
    "ToolParserManager",
    "new_tool_call_id",
]

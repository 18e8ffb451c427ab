"""Tool-call and reasoning parsers for the chat completions route, and their registries."""

from __future__ import annotations

from asyncengine.interfaces.parsers import ReasoningParser, ReasoningParserManager
from asyncengine.server.parsers.reasoning_parsers import ThinkReasoningParser
from asyncengine.server.parsers.tool_parsers import JsonTagsToolParser
from asyncengine.interfaces.parsers import ToolParser, ToolParserManager
from asyncengine.interfaces.parsers import (
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

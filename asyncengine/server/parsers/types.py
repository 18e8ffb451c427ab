"""The shapes parsers hand back to the chat completions route: moved to the floor
(asyncengine.interfaces.parsers), since a parser plugin's signatures use them; imported from there."""

from __future__ import annotations

from asyncengine.interfaces.parsers import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    FunctionCall,
    ToolCall,
    new_tool_call_id,
)

__all__ = ["DeltaFunctionCall", "DeltaMessage", "DeltaToolCall", "ExtractedToolCalls", "FunctionCall", "ToolCall",
           "new_tool_call_id"]

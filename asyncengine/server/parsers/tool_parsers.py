"""Tool-call parsers: turn a model's text into OpenAI tool calls, whole or while it streams.

`ToolParserManager` maps a name (`--tool-call-parser NAME`) to a ToolParser class; plugins add to it
with `@ToolParserManager.register_module("name")`, loaded with `--tool-parser-plugin`. Both, and the
shapes a parser returns, are in the floor (asyncengine.interfaces.parsers); this module holds the
built-in parsers, which the floor's table names by path.

Built in: `json_tags` (alias `hermes`), for models that write
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen 2.5/3 and many others).
"""

from __future__ import annotations

import json
from typing import Any

# The base class, the table and the shapes are in the floor (a plugin subclasses and fills them).
from asyncengine.interfaces.parsers import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    FunctionCall,
    ToolCall,
    ToolParser,
    new_tool_call_id,
)


# -- json_tags ------------------------------------------------------------------------------------

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def partial_tag_length(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (0 if none could).

    Streaming holds these back: sending "<tool" as content and then finding "_call>" would leak a tag.
    """
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def tool_call_from_json(body: str) -> FunctionCall | None:
    """The call described by the JSON inside one tag; None when it is not a valid call."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    return _function_call(parsed)


def _function_call(parsed: Any) -> FunctionCall | None:
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str) or not parsed["name"]:
        return None
    # Some chat templates teach the model "parameters" (the JSON-schema word) instead of "arguments".
    arguments = parsed.get("arguments", parsed.get("parameters", {}))
    if not isinstance(arguments, str):  # an object (the usual case): OpenAI's API carries it as a string
        arguments = json.dumps(arguments, ensure_ascii=False)
    return FunctionCall(name=parsed["name"], arguments=arguments)


_DECODER = json.JSONDecoder()


class JsonTagsToolParser(ToolParser):
    """Tool calls written as `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks.

    Text outside the blocks is content. A block that is not a valid call makes the whole output
    plain content: guessing at a half-understood call is worse than showing the user what the model
    wrote. A final block whose closing tag never came (the model stopped right after the JSON) still
    counts when its JSON is complete.

    Streaming sends content as it comes, holding back only what could be the start of a tag, and
    sends each call whole, as soon as its JSON object is complete. What streaming cannot undo: calls
    sent before an invalid block stay sent (the rest of the output then goes out as content), and
    text held back when the stream ends without a closing tag is never sent.
    """

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        # Streaming state: how much of current_text is dealt with, and what we are inside of.
        self._position = 0
        self._mode = "text"  # "text" | "call" (after <tool_call>) | "closing" (call sent) | "plain"
        self._call_start = 0  # where the current block's JSON begins in current_text
        self._calls_sent = 0

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCalls:
        calls: list[ToolCall] = []
        outside: list[str] = []
        position = 0
        while True:
            start = model_output.find(TOOL_CALL_START, position)
            if start == -1:
                outside.append(model_output[position:])
                break
            outside.append(model_output[position:start])
            body_start = start + len(TOOL_CALL_START)
            end = model_output.find(TOOL_CALL_END, body_start)
            body = model_output[body_start:] if end == -1 else model_output[body_start:end]
            call = tool_call_from_json(body)
            if call is None:
                return ExtractedToolCalls(tools_called=False, tool_calls=[], content=model_output)
            calls.append(ToolCall(id=new_tool_call_id(), function=call))
            if end == -1:
                break
            position = end + len(TOOL_CALL_END)
        if not calls:
            return ExtractedToolCalls(tools_called=False, tool_calls=[], content=model_output)
        content = "".join(outside).strip()
        return ExtractedToolCalls(tools_called=True, tool_calls=calls, content=content or None)

    def extract_tool_calls_streaming(
        self, previous_text: str, current_text: str, delta_text: str, request: Any
    ) -> DeltaMessage | None:
        # Work from current_text and our own position rather than delta_text, so held-back text and
        # however the route splits deltas make no difference.
        content: list[str] = []
        tool_calls: list[DeltaToolCall] = []
        while self._step(current_text, content, tool_calls):
            pass
        text = "".join(content)
        if not text and not tool_calls:
            return None
        return DeltaMessage(content=text or None, tool_calls=tool_calls or None)

    def _step(self, current: str, content: list[str], tool_calls: list[DeltaToolCall]) -> bool:
        """Deal with what it can of current_text past our position; True if another step may help."""
        rest = current[self._position:]
        if self._mode == "plain":
            content.append(rest)
            self._position = len(current)
            return False

        if self._mode == "text":
            start = rest.find(TOOL_CALL_START)
            if start == -1:
                sendable = len(rest) - partial_tag_length(rest, TOOL_CALL_START)
                content.append(rest[:sendable])
                self._position += sendable
                return False
            content.append(rest[:start])
            self._position += start + len(TOOL_CALL_START)
            self._call_start = self._position
            self._mode = "call"
            return True

        if self._mode == "call":
            body = current[self._call_start:]
            end = body.find(TOOL_CALL_END)
            if end != -1:
                call = tool_call_from_json(body[:end])
                if call is None:
                    # Not a call after all: show the block as the model wrote it, and all that follows.
                    content.append(TOOL_CALL_START + body[: end + len(TOOL_CALL_END)])
                    self._mode = "plain"
                else:
                    tool_calls.append(self._delta(call))
                    self._mode = "text"
                self._position = self._call_start + end + len(TOOL_CALL_END)
                return True
            # No closing tag yet: send the call as soon as its JSON object is complete. Decoding is
            # only tried when the text ends in "}", so a long call is not re-parsed on every token.
            stripped = body.strip()
            if not stripped.endswith("}"):
                return False
            try:
                parsed, end = _DECODER.raw_decode(stripped)
            except ValueError:
                return False
            if end != len(stripped):
                return False  # more than one JSON value: not a call; the closing tag will settle it
            call = _function_call(parsed)
            if call is None:
                return False  # a complete object that is not a call: wait for the closing tag to judge
            tool_calls.append(self._delta(call))
            self._position = len(current)
            self._mode = "closing"
            return False

        # "closing": the call is sent; drop what is left up to the closing tag (whitespace, normally).
        end = rest.find(TOOL_CALL_END)
        if end == -1:
            return False
        self._position += end + len(TOOL_CALL_END)
        self._mode = "text"
        return True

    def _delta(self, call: FunctionCall) -> DeltaToolCall:
        index = self._calls_sent
        self._calls_sent += 1
        return DeltaToolCall(
            index=index, id=new_tool_call_id(), type="function",
            function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
        )

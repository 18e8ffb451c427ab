"""A tool-call parser and a reasoning parser, registered by a general plugin.

- `example_fn` (`ExampleFnToolParser`): a tool call is a line of its own,
  `FUNCTION name({"json": "arguments"})` (empty parentheses: no arguments). Other lines are content.
- `example_brackets` (`BracketsReasoningParser`): reasoning is `[[...]]` at the very start of the
  output (whitespace aside); what follows `]]` is content. An output that does not start with `[[` is
  all content, whole or streamed.

Both have whole (non-streaming) and streaming extraction. Streaming holds back only text that may
still turn out to be a call line or an opening/closing bracket pair; the server parses the whole text
at the end of each choice and sends what was held back, so streamed and whole results add up.

`register()` is the entry point (group `asyncengine.general_plugins`). With AE_PLUGIN_RECORD naming a
file, each step (registration, first use of each extraction method) appends one JSON line there per
process, naming the pid and the process role. It imports only asyncengine.plugins_api.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from asyncengine.plugins_api import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    FunctionCall,
    ReasoningParser,
    ReasoningParserManager,
    ToolCall,
    ToolParser,
    ToolParserManager,
    current_process_role,
    new_tool_call_id,
)

__all__ = [
    "BracketsReasoningParser",
    "ExampleFnToolParser",
    "REASONING_PARSER",
    "TOOL_PARSER",
    "parse_call_line",
    "register",
]

TOOL_PARSER = "example_fn"
REASONING_PARSER = "example_brackets"

_recorded: set[str] = set()


def _record_once(what: str, **extra: Any) -> None:
    """One line per `what` and process, only when AE_PLUGIN_RECORD is set."""
    path = os.environ.get("AE_PLUGIN_RECORD")
    if not path or what in _recorded:
        return
    _recorded.add(what)
    line = {"what": what, "pid": os.getpid(), "role": current_process_role(), **extra}
    with open(path, "a", encoding="utf-8") as record:
        record.write(json.dumps(line) + "\n")


def _partial_length(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (0 if none could)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


# -- example_fn -------------------------------------------------------------------------------------

KEYWORD = "FUNCTION"
_CALL_LINE = re.compile(r"\s*FUNCTION\s+([A-Za-z_][\w.\-]*)\((.*)\)\s*", re.DOTALL)


def parse_call_line(line: str) -> FunctionCall | None:
    """The call a whole line describes (its newline included or not); None when it is not a call.

    The arguments must be a JSON object, or nothing; anything else makes the line plain content.
    """
    match = _CALL_LINE.fullmatch(line)
    if match is None or "\n" in line.rstrip("\r\n"):
        return None
    name, body = match.group(1), match.group(2).strip()
    if not body:
        arguments: Any = {}
    else:
        try:
            arguments = json.loads(body)
        except ValueError:
            return None
        if not isinstance(arguments, dict):
            return None
    return FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def _lines(text: str) -> list[str]:
    """The lines of `text`, each with its "\\n" (only "\\n" ends a line, as in streaming)."""
    pieces = text.split("\n")
    return [piece + "\n" for piece in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])


def _may_become_call_line(partial: str) -> bool:
    """Whether an unfinished line could still turn out to be a call line."""
    begun = partial.lstrip()
    return begun.startswith(KEYWORD) or KEYWORD.startswith(begun)


class ExampleFnToolParser(ToolParser):
    """Tool calls written as lines `FUNCTION name({...})`.

    Whole: every call line is a call; the other lines, newlines kept, are the content (None when
    they are blank). Without a call, the output is returned unchanged as content.

    Streaming: complete lines are judged as they end; an unfinished line is sent as content as soon
    as it cannot be a call line any more (then the rest of it is content too), and held back while it
    still could be. An unfinished last line is settled by the server's final whole parse.
    """

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self._position = 0  # how much of current_text is dealt with
        self._line_is_content = False  # the unfinished line was judged content already
        self._calls_sent = 0

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCalls:
        _record_once("tool parser extract_tool_calls", parser=TOOL_PARSER)
        calls: list[ToolCall] = []
        content: list[str] = []
        for line in _lines(model_output):
            call = parse_call_line(line)
            if call is None:
                content.append(line)
            else:
                calls.append(ToolCall(id=new_tool_call_id(), function=call))
        if not calls:
            return ExtractedToolCalls(tools_called=False, tool_calls=[], content=model_output)
        text = "".join(content)
        return ExtractedToolCalls(tools_called=True, tool_calls=calls, content=text if text.strip() else None)

    def extract_tool_calls_streaming(
        self, previous_text: str, current_text: str, delta_text: str, request: Any
    ) -> DeltaMessage | None:
        _record_once("tool parser extract_tool_calls_streaming", parser=TOOL_PARSER)
        # Work from current_text and our own position, so however the deltas are split makes no difference.
        content: list[str] = []
        tool_calls: list[DeltaToolCall] = []
        while True:
            rest = current_text[self._position:]
            if not rest:
                break
            newline = rest.find("\n")
            if newline == -1:  # an unfinished line
                if self._line_is_content or not _may_become_call_line(rest):
                    self._line_is_content = True
                    content.append(rest)
                    self._position = len(current_text)
                break  # else hold it back: it may still become a call line
            line = rest[: newline + 1]
            call = None if self._line_is_content else parse_call_line(line)
            if call is None:
                content.append(line)
            else:
                tool_calls.append(self._delta(call))
            self._position += newline + 1
            self._line_is_content = False
        text = "".join(content)
        if not text and not tool_calls:
            return None
        return DeltaMessage(content=text or None, tool_calls=tool_calls or None)

    def _delta(self, call: FunctionCall) -> DeltaToolCall:
        index = self._calls_sent
        self._calls_sent += 1
        return DeltaToolCall(index=index, id=new_tool_call_id(), type="function",
                             function=DeltaFunctionCall(name=call.name, arguments=call.arguments))


# -- example_brackets -------------------------------------------------------------------------------

OPEN = "[["
CLOSE = "]]"


class BracketsReasoningParser(ReasoningParser):
    """Reasoning inside `[[...]]` at the start of the output.

    Whole: `[[` at the start (whitespace aside) opens reasoning, the first `]]` closes it, and what
    follows is content; never closed, all of it is reasoning. Without `[[` at the start, the whole
    output is content (a `[[` later on is text).

    Streaming agrees with that: it waits only while the start could still be `[[` (leading
    whitespace, or a single `[`), and in reasoning holds back a trailing `]`.
    """

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self._position = 0
        self._mode = "start"  # "start" | "reasoning" | "content"

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        _record_once("reasoning parser extract_reasoning", parser=REASONING_PARSER)
        begun = model_output.lstrip()
        if not begun.startswith(OPEN):
            return None, model_output or None
        reasoning, closed, content = begun[len(OPEN):].partition(CLOSE)
        if not closed:
            return reasoning or None, None
        return reasoning or None, content or None

    def extract_reasoning_streaming(
        self, previous_text: str, current_text: str, delta_text: str, request: Any
    ) -> DeltaMessage | None:
        _record_once("reasoning parser extract_reasoning_streaming", parser=REASONING_PARSER)
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            rest = current_text[self._position:]
            if self._mode == "start":
                begun = rest.lstrip()
                if not begun or OPEN.startswith(begun):
                    break  # whitespace, or what may become "[[": wait
                if begun.startswith(OPEN):
                    self._position += len(rest) - len(begun) + len(OPEN)
                    self._mode = "reasoning"
                else:
                    self._mode = "content"  # leading whitespace included, as in the whole parse
            elif self._mode == "reasoning":
                end = rest.find(CLOSE)
                if end == -1:
                    sendable = len(rest) - _partial_length(rest, CLOSE)
                    reasoning.append(rest[:sendable])
                    self._position += sendable
                    break
                reasoning.append(rest[:end])
                self._position += end + len(CLOSE)
                self._mode = "content"
            else:
                content.append(rest)
                self._position = len(current_text)
                break
        reasoning_text, content_text = "".join(reasoning), "".join(content)
        if not reasoning_text and not content_text:
            return None
        return DeltaMessage(reasoning_content=reasoning_text or None, content=content_text or None)


# -- the entry point --------------------------------------------------------------------------------

def register() -> None:
    """Entry point (asyncengine.general_plugins): register both parsers. Registering again is a no-op."""
    ToolParserManager.register_module(TOOL_PARSER, module=ExampleFnToolParser)
    ReasoningParserManager.register_module(REASONING_PARSER, module=BracketsReasoningParser)
    _record_once("parsers registered", tool_parser=TOOL_PARSER, reasoning_parser=REASONING_PARSER)

"""`pythonic` (alias `llama4_pythonic`): tool calls written as a Python list of calls, as Llama 3.2,
Llama 4 and ToolACE models write them (vLLM's names):

    [get_weather(city="Paris", unit="celsius"), get_time(tz='Europe/Paris')]

Llama 4 may wrap the list in `<|python_start|>` ... `<|python_end|>`. Keyword arguments only; their
values are Python literals (strings, numbers, True/False/None, lists, tuples, dicts), carried as JSON.
The list must open the output; an output that opens with anything else is content, and so is one
whose list turns out not to be calls (`[1] See the footnote`). Text after the list is content.

Streamed, each call's arguments go out one keyword argument at a time, as each value completes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from asyncengine.server.parsers.incremental import (
    IncrementalToolParser,
    ScannedCall,
    ToolScan,
    add_trailing_content,
    read_list,
)
from asyncengine.server.parsers.text_scan import (
    MalformedText,
    is_prefix_of_any,
    python_literal_as_json,
    python_value_end,
    skip_space,
)

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


def json_member(name: str, value: Any) -> str:
    """One `"name": value` member of an arguments object, written the same way whole or streamed."""
    return f"{json.dumps(name, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False, allow_nan=False)}"


class PythonicToolParser(IncrementalToolParser):
    """A Python list of keyword-argument calls opening the output (see the module's docstring)."""

    def read(self, text: str, request: Any, final: bool, scan: ToolScan) -> None:
        start = skip_space(text, 0)
        if not final and is_prefix_of_any(text[start:], (PYTHON_START,)):
            return  # nothing yet, or what may become <|python_start|>: a list may still open
        marked = text.startswith(PYTHON_START, start)
        position = skip_space(text, start + len(PYTHON_START)) if marked else start
        scan.reading_from = start
        if position >= len(text) or text[position] != "[":
            if marked:
                if position < len(text):
                    raise MalformedText("expected a list of calls after <|python_start|>")
                scan.ended_early(final)
            else:
                scan.add_content(0, len(text))
            return
        list_end = read_list(text, position + 1, scan, final, lambda start: self._read_call(text, start, scan))
        if list_end is None:
            return
        position = skip_space(text, list_end)
        if text.startswith(PYTHON_END, position):
            position += len(PYTHON_END)
        elif not final and is_prefix_of_any(text[position:], (PYTHON_END,)):
            return
        add_trailing_content(text, position, scan, final)

    @staticmethod
    def _read_call(text: str, start: int, scan: ToolScan) -> int | None:
        name = _IDENTIFIER.match(text, start)
        if name is None:
            raise MalformedText(f"expected a function name at {start}")
        if name.end() >= len(text):
            return None  # the name may go on
        if text[name.end()] != "(":
            raise MalformedText(f"expected '(' after {name.group()!r}")
        call = ScannedCall(name=name.group())
        members: list[str] = []
        started = False  # a stream starts the call at its first keyword (or its ")"), not at its name
        position = name.end() + 1
        while True:
            position = skip_space(text, position)
            if position >= len(text):
                return None
            if text[position] == ")":
                call.arguments, call.complete = "{" + ", ".join(members) + "}", True
                if not started:
                    scan.calls.append(call)
                return position + 1
            keyword = _IDENTIFIER.match(text, position)
            if keyword is None:
                raise MalformedText("tool call arguments must be keyword arguments (name=value)")
            equals = skip_space(text, keyword.end())
            if equals >= len(text):
                return None
            if text[equals] != "=" or text.startswith("==", equals):
                raise MalformedText("tool call arguments must be keyword arguments (name=value)")
            if not started:
                scan.calls.append(call)
                started = True
            end = python_value_end(text, equals + 1, scan.memo)
            if end is None:
                return None
            members.append(json_member(keyword.group(), python_literal_as_json(text[equals + 1:end])))
            call.arguments = "{" + ", ".join(members)
            position = end + 1 if text[end] == "," else end

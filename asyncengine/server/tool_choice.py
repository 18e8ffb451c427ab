"""`tool_choice` of chat completions: "none", "auto", "required", or a named function.

"auto" leaves the choice to the model, and the configured tool parser finds the calls in its text.
"required" and a named function force a call through structured output, as vLLM does: the output is
constrained to a JSON schema built from the tools' parameter schemas, so it parses by construction,
and `ForcedToolParser` turns it into tool calls in OpenAI's shape. Neither needs a tool parser or
--enable-auto-tool-choice.

- named (`{"type": "function", "function": {"name": "f"}}`): the output is f's arguments, constrained
  to f's `parameters` schema (any object when it has none).
- "required": the output is a JSON array of at least one `{"name": ..., "parameters": ...}`, each item
  one of the tools (its name as a one-value enum, its parameters schema); `$defs` of the tools'
  schemas are lifted to the top, where their `#/$defs/...` references resolve. With
  `parallel_tool_calls` false the array holds exactly one call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from asyncengine.interfaces.parsers import (
    DeltaFunctionCall, DeltaMessage, DeltaToolCall, ExtractedToolCalls, FunctionCall, ToolCall, ToolParser,
    new_tool_call_id,
)
from asyncengine.server.errors import bad_request
from asyncengine.structured_output_spec import StructuredOutputsParams

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ForcedTools:
    """A tool call the request forces: `name` for a named function, None for "required"."""

    name: str | None
    schema: dict[str, Any]
    param: str  # the request field a refused schema is blamed on

    @property
    def structured_outputs(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.schema)

    def parser(self) -> ForcedToolParser:
        return ForcedToolParser(self.name)


def forced_tools(request: Any) -> ForcedTools | None:
    """The forced call of `request`, None for "none", "auto" or no tool_choice; a 400 naming the field
    for a tool_choice that is malformed, names no tool of `tools`, or comes with a response format."""
    choice = request.tool_choice
    if choice is None or choice in ("none", "auto"):
        return None
    if isinstance(choice, str) and choice != "required":
        raise bad_request(f"tool_choice {choice!r} is not one of 'none', 'auto', 'required' or "
                          '{"type": "function", "function": {"name": ...}}', param="tool_choice", code="invalid_value")
    tools = request.tools or []
    if not tools:
        raise bad_request(f"tool_choice {_shown(choice)} needs tools: the request has none", param="tool_choice",
                          code="invalid_value")
    if (request.response_format or {}).get("type", "text") != "text" or request.structured_outputs is not None:
        raise bad_request(f"tool_choice {_shown(choice)} constrains the output to a tool call, and the request asks "
                          "for structured output too (response_format or structured_outputs): send one",
                          param="tool_choice", code="invalid_value")
    if choice == "required":
        return ForcedTools(None, _required_schema(tools, single=getattr(request, "parallel_tool_calls", None) is False),
                           "tools")
    name = _named(choice)
    for index, tool in enumerate(tools):
        if tool.function.name == name:
            return ForcedTools(name, tool.function.parameters or ANY_OBJECT, f"tools[{index}].function.parameters")
    known = ", ".join(repr(tool.function.name) for tool in tools)
    raise bad_request(f"tool_choice names function {name!r}, which is not among the request's tools ({known})",
                      param="tool_choice", code="invalid_value")


def _named(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(choice, dict) and choice.get("type", "function") == "function" and isinstance(name, str)
            and name):
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                          f'{{"name": ...}}}}, got {_shown(choice)}', param="tool_choice", code="invalid_value")
    return name


def _shown(choice: Any) -> str:
    text = json.dumps(choice) if not isinstance(choice, str) else repr(choice)
    return text if len(text) <= 120 else text[:117] + "..."


def _required_schema(tools: list[Any], *, single: bool) -> dict[str, Any]:
    defs: dict[str, Any] = {}
    variants = []
    for index, tool in enumerate(tools):
        parameters = dict(tool.function.parameters or ANY_OBJECT)
        for def_name, definition in (parameters.pop("$defs", None) or {}).items():
            if def_name in defs and defs[def_name] != definition:
                raise bad_request(f"tools define $defs {def_name!r} differently; tool_choice 'required' joins every "
                                  "tool's $defs in one schema, so give them different names",
                                  param=f"tools[{index}].function.parameters.$defs", code="invalid_value")
            defs[def_name] = definition
        variants.append({"type": "object",
                         "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                        "parameters": parameters},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if single:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def complete_items(text: str) -> list[Any]:
    """The complete items at the start of a JSON array's text, however far it got: '[{"a": 1}, {"b'
    gives [{"a": 1}]. The constrained output is always a prefix of a valid array."""
    decoder = json.JSONDecoder()
    position = text.find("[")
    if position < 0:
        return []
    position += 1
    items: list[Any] = []
    while True:
        while position < len(text) and text[position] in " \t\n\r,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return items
        try:
            item, position = decoder.raw_decode(text, position)
        except ValueError:  # the item is still being written
            return items
        items.append(item)


class ForcedToolParser(ToolParser):
    """The tool calls of a forced output: a named function's arguments, or "required"'s array."""

    def __init__(self, name: str | None) -> None:
        super().__init__(None)
        self.name = name
        self._ids: list[str] = []  # one per call, the same in a stream's deltas and its end
        self._sent = 0  # calls of a "required" stream sent so far

    def _id(self, index: int) -> str:
        while len(self._ids) <= index:
            self._ids.append(new_tool_call_id())
        return self._ids[index]

    def _calls(self, text: str) -> list[ToolCall]:
        if self.name is not None:
            # The arguments as the model wrote them: what a stream's deltas add up to (valid JSON when the
            # output stopped; cut where max_tokens ran out otherwise).
            return [ToolCall(id=self._id(0), function=FunctionCall(name=self.name, arguments=text))]
        return [ToolCall(id=self._id(index), function=FunctionCall(name=item["name"],
                                                                   arguments=json.dumps(item["parameters"])))
                for index, item in enumerate(complete_items(text))
                if isinstance(item, dict) and isinstance(item.get("name"), str) and "parameters" in item]

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCalls:
        calls = self._calls(model_output)
        return ExtractedToolCalls(tools_called=bool(calls), tool_calls=calls,
                                  content=None if calls or not model_output else model_output)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     request: Any) -> DeltaMessage | None:
        if self.name is not None:  # the arguments as they come; the name with the first piece
            first = not previous_text
            return DeltaMessage(tool_calls=[DeltaToolCall(
                index=0, id=self._id(0) if first else None, type="function" if first else None,
                function=DeltaFunctionCall(name=self.name if first else None, arguments=delta_text))])
        calls = self._calls(current_text)[self._sent:]  # each call whole, once its item is complete
        if not calls:
            return None
        deltas = [DeltaToolCall(index=self._sent + offset, id=call.id, type="function",
                                function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments))
                  for offset, call in enumerate(calls)]
        self._sent += len(calls)
        return DeltaMessage(tool_calls=deltas)


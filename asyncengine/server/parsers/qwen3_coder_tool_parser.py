"""`qwen3_coder`: Qwen3-Coder's (and Qwen3.5's) XML tool calls (vLLM's name):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is text (one newline after its opening tag and one before its closing tag are
layout, not value); it becomes the JSON type the request's tool schema gives that parameter, as vLLM
converts it: integers, numbers, booleans, null for a nullable one, objects and arrays parsed as JSON
(or as a Python literal). A value that does not read as its type stays a string (vLLM turns a boolean
it cannot read into false; here the client sees what the model wrote). A parameter the schema does
not name stays a string. Text around the calls is content.

Streamed, each call's arguments go out one parameter at a time, as each closes.
"""

from __future__ import annotations

import json
import math
from typing import Any

from asyncengine.server.parsers.incremental import IncrementalToolParser, ScannedCall, ToolScan, read_marked_blocks
from asyncengine.server.parsers.pythonic_tool_parser import json_member
from asyncengine.server.parsers.text_scan import (
    MalformedText,
    is_prefix_of_any,
    python_literal_as_json,
    skip_space,
)

TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"

_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
_NULLS = {"null", "none"}


class Qwen3CoderToolParser(IncrementalToolParser):
    """`<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>` blocks (see
    the module's docstring)."""

    def read(self, text: str, request: Any, final: bool, scan: ToolScan) -> None:
        read_marked_blocks(text, scan, final, TOOL_CALL, TOOL_CALL_END,
                           lambda start: self._read_function(text, start, request, scan))

    @staticmethod
    def _read_function(text: str, start: int, request: Any, scan: ToolScan) -> int | None:
        """Read `<function=NAME>...</function>` at `start`; where it ends, or None while it has not."""
        if not text.startswith(FUNCTION, start):
            if is_prefix_of_any(text[start:], (FUNCTION,)):
                return None
            raise MalformedText("expected <function=NAME> after <tool_call>")
        name_end = text.find(">", start + len(FUNCTION))
        if name_end == -1:
            return None
        name = text[start + len(FUNCTION):name_end].strip()
        if not name or "<" in name or "\n" in name:
            raise MalformedText(f"{name!r} is not a function name")
        call = ScannedCall(name=name)
        scan.calls.append(call)
        properties = tool_properties(request, name)
        members: list[str] = []
        position = name_end + 1
        while True:
            position = skip_space(text, position)
            if text.startswith(FUNCTION_END, position):
                call.arguments, call.complete = "{" + ", ".join(members) + "}", True
                return position + len(FUNCTION_END)
            if not text.startswith(PARAMETER, position):
                if is_prefix_of_any(text[position:], (FUNCTION_END, PARAMETER)):
                    return None
                raise MalformedText("expected <parameter=NAME> or </function>")
            parameter_end = text.find(">", position + len(PARAMETER))
            value_end = text.find(PARAMETER_END, parameter_end + 1) if parameter_end != -1 else -1
            if value_end == -1:
                return None
            parameter = text[position + len(PARAMETER):parameter_end].strip()
            value = text[parameter_end + 1:value_end]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            members.append(json_member(parameter, convert_parameter(value, parameter, properties)))
            call.arguments = "{" + ", ".join(members)
            position = value_end + len(PARAMETER_END)


def tool_properties(request: Any, name: str) -> dict[str, Any]:
    """The JSON-schema properties of the request's tool `name` ({} when the request has no such tool)."""
    for tool in getattr(request, "tools", None) or []:
        function = tool.get("function") if isinstance(tool, dict) else getattr(tool, "function", None)
        if function is None:
            continue
        function_name = function.get("name") if isinstance(function, dict) else getattr(function, "name", None)
        if function_name != name:
            continue
        parameters = function.get("parameters") if isinstance(function, dict) else getattr(function, "parameters", None)
        properties = (parameters or {}).get("properties") if isinstance(parameters, dict) else None
        return properties if isinstance(properties, dict) else {}
    return {}


def _schema_type(schema: Any) -> tuple[str, bool]:
    """(the type a parameter's value converts to, whether null is allowed) from its JSON schema."""
    if not isinstance(schema, dict):
        return "string", False
    declared = schema.get("type")
    if isinstance(declared, list):
        types = [str(item).strip().lower() for item in declared]
        others = [item for item in types if item != "null"]
        return (others[0] if others else "null"), "null" in types
    if declared is not None:
        kind = str(declared).strip().lower()
        return kind, kind == "null"
    for union in ("anyOf", "oneOf"):
        if isinstance(schema.get(union), list):
            kinds = [_schema_type(option) for option in schema[union]]
            others = [kind for kind, _ in kinds if kind != "null"]
            return (others[0] if others else "null"), any(kind == "null" or nullable for kind, nullable in kinds)
    return "string", False


def convert_parameter(value: str, name: str, properties: dict[str, Any]) -> Any:
    """A parameter's text as the JSON value its schema asks for (see the module's docstring)."""
    if name not in properties:
        return value
    kind, nullable = _schema_type(properties[name])
    lowered = value.strip().lower()
    if lowered in _NULLS and (nullable or kind not in _STRING_TYPES):
        return None
    if kind in _STRING_TYPES:
        return value
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float", "double")):
        try:
            number = float(value)
        except ValueError:
            return value
        if not math.isfinite(number):
            return value
        return int(number) if number.is_integer() and "." not in value and "e" not in lowered else number
    if kind in ("boolean", "bool", "binary"):
        return {"true": True, "false": False}.get(lowered, value)
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            parsed = json.loads(value)
            if not isinstance(parsed, str):
                return parsed
        except ValueError:
            pass
    try:
        return python_literal_as_json(value)
    except MalformedText:
        return value

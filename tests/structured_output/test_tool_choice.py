"""tool_choice "required" and a named function (asyncengine/server/tool_choice.py), without a model:
the 400s naming tool_choice, the JSON schema each builds from the tools (checked with jsonschema on the
outputs it must allow and refuse), and the parser that turns the constrained output into tool calls,
whole and streamed. The real thing, through the server with the official client, is in
tests/server/test_structured_outputs.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest

from asyncengine.server.errors import ApiError
from asyncengine.server.protocol import FunctionDefinition, Tool
from asyncengine.server.tool_choice import ForcedToolParser, complete_items, forced_tools

WEATHER = Tool(function=FunctionDefinition(name="get_weather", parameters={
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}))
CLOCK = Tool(function=FunctionDefinition(name="get_time", parameters={
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"],
    "$defs": {"zone": {"enum": ["utc", "cet"]}}}))
NO_PARAMETERS = Tool(function=FunctionDefinition(name="ping"))


def request(tool_choice, tools=(WEATHER, CLOCK), **fields):
    return SimpleNamespace(tool_choice=tool_choice, tools=list(tools), response_format=fields.get("response_format"),
                           structured_outputs=fields.get("structured_outputs"),
                           parallel_tool_calls=fields.get("parallel_tool_calls"))


@pytest.mark.parametrize("choice", [None, "none", "auto"])
def test_none_and_auto_force_nothing(choice):
    assert forced_tools(request(choice)) is None


@pytest.mark.parametrize("choice, tools, fields, words", [
    ({"type": "function", "function": {"name": "get_stock"}}, (WEATHER, CLOCK), {},
     ["get_stock", "not among", "'get_weather', 'get_time'"]),
    ("required", (), {}, ["needs tools"]),
    ("always", (WEATHER,), {}, ["'always'", "'required'"]),
    ({"type": "function"}, (WEATHER,), {}, ["tool_choice must be"]),
    ({"type": "function", "function": {"name": ""}}, (WEATHER,), {}, ["tool_choice must be"]),
    ("required", (WEATHER,), {"response_format": {"type": "json_object"}}, ["structured output too"]),
    ({"type": "function", "function": {"name": "get_weather"}}, (WEATHER,), {"structured_outputs": {"regex": "a"}},
     ["structured output too"]),
])
def test_a_bad_tool_choice_is_a_400_naming_the_field(choice, tools, fields, words):
    with pytest.raises(ApiError) as refused:
        forced_tools(request(choice, tools, **fields))
    assert (refused.value.status, refused.value.param) == (400, "tool_choice")
    assert all(word in refused.value.message for word in words), refused.value.message


def test_a_response_format_of_text_is_no_conflict():
    assert forced_tools(request("required", response_format={"type": "text"})) is not None


def test_a_named_function_constrains_to_its_parameters():
    forced = forced_tools(request({"type": "function", "function": {"name": "get_weather"}}))
    assert forced.name == "get_weather" and forced.param == "tools[0].function.parameters"
    assert forced.structured_outputs.json == WEATHER.function.parameters
    no_parameters = forced_tools(request({"type": "function", "function": {"name": "ping"}}, (WEATHER, NO_PARAMETERS)))
    assert no_parameters.schema == {"type": "object"}


def test_required_allows_arrays_of_the_tools_calls_only():
    schema = forced_tools(request("required")).schema
    assert schema["$defs"] == {"zone": {"enum": ["utc", "cet"]}}  # lifted, so that #/$defs/zone resolves
    good = [{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}},
            {"name": "get_time", "parameters": {"zone": "cet"}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_stock", "parameters": {}}], [{"name": "get_time", "parameters": {"zone": "pst"}}],
                [{"name": "get_weather", "parameters": {"city": "Oslo"}}], [{"name": "get_time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_required_without_parallel_tool_calls_allows_one_call_only():
    call = {"name": "get_time", "parameters": {"zone": "utc"}}
    jsonschema.validate([call, call], forced_tools(request("required", parallel_tool_calls=True)).schema)
    single = forced_tools(request("required", parallel_tool_calls=False)).schema
    jsonschema.validate([call], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([call, call], single)


def test_required_refuses_tools_whose_defs_clash():
    other = Tool(function=FunctionDefinition(name="other", parameters={
        "type": "object", "properties": {"z": {"$ref": "#/$defs/zone"}}, "$defs": {"zone": {"type": "integer"}}}))
    with pytest.raises(ApiError) as refused:
        forced_tools(request("required", (CLOCK, other)))
    assert refused.value.param == "tools[1].function.parameters.$defs" and "'zone'" in refused.value.message


def test_complete_items_of_an_array_cut_anywhere():
    text = '[{"name": "a", "parameters": {"x": [1, 2]}}, {"name": "b", "parameters": {}} ]'
    for end in range(len(text) + 1):
        whole = text.count("}}", 0, end)  # an item ends with "}}" here
        assert len(complete_items(text[:end])) == whole, text[:end]
    assert complete_items(" \n[]") == []


def test_a_named_call_is_its_arguments_whole_and_streamed():
    output = '{"city": "Oslo",  "unit": "c"}'
    whole = ForcedToolParser("get_weather").extract_tool_calls(output, None)
    assert whole.tools_called and whole.content is None
    [call] = whole.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", "get_weather", output)
    assert call.id.startswith("call_")
    parser, previous, deltas = ForcedToolParser("get_weather"), "", []
    for piece in ('{"ci', 'ty": "Os', 'lo",  "unit": "c"}'):
        deltas += parser.extract_tool_calls_streaming(previous, previous + piece, piece, None).tool_calls
        previous += piece
    assert [d.index for d in deltas] == [0, 0, 0]
    assert deltas[0].id.startswith("call_") and deltas[0].type == "function" and deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])  # OpenAI's shape: name and id once
    assert "".join(d.function.arguments for d in deltas) == output


def test_required_calls_stream_as_each_item_completes():
    items = [{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}},
             {"name": "get_time", "parameters": {"zone": "utc"}}]
    output = json.dumps(items)
    parser, sent = ForcedToolParser(None), []
    for end in range(1, len(output) + 1):
        delta = parser.extract_tool_calls_streaming(output[:end - 1], output[:end], output[end - 1], None)
        sent += delta.tool_calls if delta else []
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in sent] == [
        (0, "get_weather", items[0]["parameters"]), (1, "get_time", items[1]["parameters"])]
    whole = parser.extract_tool_calls(output, None)  # the stream's end: the same calls, the same ids
    assert [c.id for c in whole.tool_calls] == [d.id for d in sent]
    cut = ForcedToolParser(None).extract_tool_calls(output[:-10], None)  # max_tokens ran out in the second call
    assert [c.function.name for c in cut.tool_calls] == ["get_weather"]

"""Structured outputs through the real server with the official `openai` client (issue 16): seeded JSON
schemas as `response_format` json_schema, streamed, parse and validate; vLLM's `structured_outputs` extra
body on completions; a bad schema or regex is a 400 naming the field and the backend."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from structured_output.schemas import SCHEMAS
from support.server import API_KEY, MODEL_NAME

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(smol_server):
    with openai.OpenAI(base_url=smol_server.base_url, api_key=API_KEY, max_retries=0, timeout=600) as client:
        yield client


@pytest.mark.parametrize("seed", range(5))
def test_a_streamed_json_schema_response_validates(client, seed):
    schema = SCHEMAS[seed]
    stream = client.chat.completions.create(
        model=MODEL_NAME, temperature=0, max_tokens=256, stream=True,
        messages=[{"role": "user", "content": f"Write one example JSON document for this schema: {json.dumps(schema)}"}],
        response_format={"type": "json_schema", "json_schema": {"name": f"s{seed}", "schema": schema, "strict": True}})
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    jsonschema.validate(json.loads(text), schema)
    assert finish == "stop"


def test_the_structured_outputs_extra_body_on_completions(client):
    completion = client.completions.create(model=MODEL_NAME, prompt="My phone number is", max_tokens=32,
                                           temperature=0.8, seed=5,
                                           extra_body={"structured_outputs": {"regex": r" [0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", completion.choices[0].text)
    assert completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, param, backend", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                         "minProperties": "x"}}}},
     "structured_outputs.json", "xgrammar"),
    ({"structured_outputs": {"regex": "(a", "backend": "guidance"}}, "structured_outputs.regex", "guidance"),
])
def test_a_refused_grammar_is_a_400_naming_the_field_and_the_backend(client, body, param, backend):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       extra_body=body)
    error = refused.value.body
    assert error["param"] == param and f"backend {backend!r}" in error["message"], error


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet", "pst"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
SCHEMA_OF = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def test_a_named_tool_choice_forces_that_call_through_its_parameter_schema(client):
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK_WEATHER, tools=TOOLS, temperature=0, max_tokens=96,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = completion.choices[0]
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF["get_time"])
    assert choice.finish_reason == "tool_calls" and choice.message.content is None


def test_tool_choice_required_streams_calls_of_the_given_tools(client):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=ASK_WEATHER, tools=TOOLS, temperature=0,
                                            max_tokens=160, tool_choice="required", stream=True)
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or delta.id
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    assert calls and finish == "tool_calls" and content == "", (calls, finish, content)
    for call in calls.values():
        assert call["id"].startswith("call_") and call["name"] in SCHEMA_OF, call
        jsonschema.validate(json.loads(call["arguments"]), SCHEMA_OF[call["name"]])


@pytest.mark.parametrize("tools, tool_choice, param, words", [
    (TOOLS, {"type": "function", "function": {"name": "get_stock"}}, "tool_choice", "not among"),
    ([], "required", "tool_choice", "needs tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}}}],
     {"type": "function", "function": {"name": "f"}}, "tools[0].function.parameters", "backend 'xgrammar'"),
])
def test_a_bad_forced_tool_call_is_a_400_naming_the_field(client, tools, tool_choice, param, words):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL_NAME, messages=ASK_WEATHER, tools=tools or openai.NOT_GIVEN,
                                       tool_choice=tool_choice, max_tokens=8)
    error = refused.value.body
    assert error["param"] == param and words in error["message"], error

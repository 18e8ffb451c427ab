"""OpenAI's Responses API on the real server (the shared default-model server) through the official client's
`client.responses` (issue 32, item 3 and acceptance 2): plain, streamed, with a forced tool call, with
`text.format` json_schema, continued with `previous_response_id`, retrieved and cancelled; the stream's
event types in OpenAI's documented order; hostile bodies answered 4xx, never 5xx.

The reference is the chat route of the same server: a Responses request is the chat request it amounts
to, so with greedy sampling its text and token counts equal those of the equivalent chat completion.
Where the model's words would be guessed, structured output fixes them (a forced call's arguments follow
the tool's schema; json_schema output is validated with jsonschema)."""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse

import jsonschema
import openai
import pytest

from support.server import API_KEY, MODEL_NAME, metric, start_server

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France? Answer in one word."
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
TEXT_EVENTS_HEAD = ["response.created", "response.in_progress", "response.output_item.added",
                    "response.content_part.added"]
TEXT_EVENTS_TAIL = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                    "response.completed"]


@pytest.fixture(scope="module")
def server(default_model_dir):
    """This module's server: the default model with a small KV cache (256 MiB: 5824 tokens) and a 4096-token context."""
    server = start_server([str(default_model_dir), "--served-model-name", MODEL_NAME, "--api-key", API_KEY,
                           "--kv-cache-memory-bytes", str(256 * 2**20), "--max-model-len", "4096"])
    yield server
    assert server.stop() == 0, server.stderr()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=300) as client:
        yield client


def chat(client, messages: list, max_tokens: int) -> tuple[str, int, int]:
    """The chat route's greedy answer: (text, prompt tokens, completion tokens)."""
    response = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens,
                                              temperature=0)
    return response.choices[0].message.content, response.usage.prompt_tokens, response.usage.completion_tokens


def send(server, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    url = urllib.parse.urlsplit(server.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    try:
        connection.request(method, path, body=body, headers={"Authorization": f"Bearer {API_KEY}",
                                                             "Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.fixture(scope="module")
def plain(client):
    """One plain response (stored, not background), shared by the tests that read it."""
    return client.responses.create(model=MODEL_NAME, input=QUESTION, instructions="You are a geography tutor.",
                                   max_output_tokens=24, temperature=0, metadata={"ticket": "42"})


@pytest.fixture(scope="module")
def forced_call(client):
    return client.responses.create(model=MODEL_NAME, input="What is the weather like in Paris?", tools=[WEATHER],
                                   tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                                   temperature=0)


def test_a_plain_response_is_the_chat_answer_in_the_responses_shape(client, plain):
    text, prompt_tokens, completion_tokens = chat(client, [{"role": "system", "content": "You are a geography tutor."},
                                                           {"role": "user", "content": QUESTION}], 24)
    assert plain.object == "response" and plain.status == "completed" and plain.model == MODEL_NAME
    (message,) = plain.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert plain.output_text == text and text
    assert (plain.usage.input_tokens, plain.usage.output_tokens) == (prompt_tokens, completion_tokens)
    assert plain.usage.total_tokens == prompt_tokens + completion_tokens
    assert plain.metadata == {"ticket": "42"} and plain.instructions == "You are a geography tutor."
    assert plain.id.startswith("resp_") and message.id.startswith("msg_")
    assert client.responses.retrieve(plain.id).model_dump() == plain.model_dump()  # stored as answered


def test_a_streamed_response_follows_openais_event_sequence(client, plain):
    events = list(client.responses.create(model=MODEL_NAME, input=QUESTION, instructions="You are a geography tutor.",
                                          max_output_tokens=24, temperature=0, stream=True))
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == TEXT_EVENTS_HEAD + ["response.output_text.delta"] * deltas + TEXT_EVENTS_TAIL and deltas > 1
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    done = events[-4]
    assert text == done.text == plain.output_text  # greedy: the same text as the whole response
    item_id = events[2].item.id
    assert all(event.item_id == item_id for event in events[3:-2])
    final = events[-1].response
    assert final.status == "completed" and final.output_text == plain.output_text and final.output[0].id == item_id
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_a_forced_tool_call_is_a_function_call_item_whole_and_streamed(client, forced_call):
    (call,) = forced_call.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert call.call_id.startswith("call_") and forced_call.tools[0].name == "get_weather"

    events = list(client.responses.create(model=MODEL_NAME, input="What is the weather like in Paris?",
                                          tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=40, temperature=0, stream=True))
    kinds = [event.type for event in events]
    deltas = kinds.count("response.function_call_arguments.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * deltas, "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"] and deltas >= 1
    streamed = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    assert streamed == events[-3].arguments == call.arguments  # greedy: the same call
    assert events[2].item.name == "get_weather" and events[-1].response.output[0].call_id == events[2].item.call_id


def test_the_tool_result_goes_back_as_input_items_as_chat_would_send_it(client, forced_call):
    question = "What is the weather like in Paris?"
    (call,) = forced_call.output
    answer = client.responses.create(
        model=MODEL_NAME, tools=[WEATHER], tool_choice="none", max_output_tokens=12, temperature=0,
        input=[{"role": "user", "content": question}, call,  # the output item as the client received it
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}])
    expected = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=12, temperature=0, tool_choice="none",
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        messages=[{"role": "user", "content": question},
                  {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                                                                         "function": {"name": call.name,
                                                                                      "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees and sunny"}])
    assert answer.output_text == expected.choices[0].message.content
    assert answer.usage.input_tokens == expected.usage.prompt_tokens


def test_text_format_json_schema_gives_json_the_schema_validates(client):
    response = client.responses.create(model=MODEL_NAME, input="Describe a person.", max_output_tokens=60,
                                       temperature=0, text={"format": {"type": "json_schema", "name": "person",
                                                                       "schema": PERSON, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.text.format.type == "json_schema"


def test_previous_response_id_continues_the_stored_conversation(client):
    first = client.responses.create(model=MODEL_NAME, input="Name a fruit.", instructions="Answer briefly.",
                                    max_output_tokens=12, temperature=0, store=True)
    second = client.responses.create(model=MODEL_NAME, input="And a vegetable?", previous_response_id=first.id,
                                     max_output_tokens=12, temperature=0)
    # The earlier input and output come first; the earlier instructions do not (OpenAI's rule).
    text, prompt_tokens, _ = chat(client, [{"role": "user", "content": "Name a fruit."},
                                           {"role": "assistant", "content": first.output_text},
                                           {"role": "user", "content": "And a vegetable?"}], 12)
    assert second.previous_response_id == first.id
    assert (second.output_text, second.usage.input_tokens) == (text, prompt_tokens)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=MODEL_NAME, input="x", previous_response_id="resp_never_made")
    assert info.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_background_response_runs_after_the_answer_and_cancel_aborts_it(client, server, plain):
    done = client.responses.create(model=MODEL_NAME, input="Tell me a long story.", background=True,
                                   max_output_tokens=3, temperature=0)
    assert done.status == "queued" and done.output == [] and done.background
    deadline = time.monotonic() + 120
    while (polled := client.responses.retrieve(done.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, polled
        time.sleep(0.2)
    # Cut by max_output_tokens: incomplete, saying why.
    assert polled.status == "incomplete" and polled.incomplete_details.reason == "max_output_tokens"
    assert polled.usage.output_tokens == 3 and polled.output[0].status == "incomplete" and polled.output_text
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(done.id)  # finished: nothing to cancel

    long = client.responses.create(model=MODEL_NAME, input="Write a very long story.", background=True,
                                   max_output_tokens=3000, extra_body={"ignore_eos": True})
    while client.responses.retrieve(long.id).status == "queued":
        time.sleep(0.05)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"
    assert client.responses.cancel(long.id).status == "cancelled"  # cancelling again answers it as it is
    deadline = time.monotonic() + 30
    while metric(server, "num_requests_running") != 0:  # the engine request was aborted, not left running
        assert time.monotonic() < deadline, "the cancelled request still runs"
        time.sleep(0.1)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(plain.id)  # OpenAI cancels background responses only
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_never_made")


HOSTILE = [
    ({"input": [{"role": "user", "content": "x"}] * 10_001}, "input"),
    ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type"),
    ({"input": [3]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tool_choice": {"type": "mcp", "server_label": "s"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "max_output_tokens": 10**12}, "max_output_tokens"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"model": MODEL_NAME}, "input"),
]
DEEP = "[" * 10_000 + "]" * 10_000


def test_hostile_bodies_are_4xx_naming_the_field_and_the_server_goes_on(server):
    bodies = [(json.dumps(body).encode(), param) for body, param in HOSTILE] + [
        (b'{"input": ' + DEEP.encode() + b"}", "input[0]"),
        (b'{"input": [{"role": "user", "content": "x", "extra": ' + DEEP.encode() + b"}]}", "input"),
        (b'{"input": "x", "tool_choice": ' + DEEP.encode() + b"}", "tool_choice"),
        (b'{"input": "x", "text": {"format": {"type": "json_schema", "schema": ' + ('{"a":' * 5000).encode()
         + b"1" + b"}" * 5000 + b"}}}", "text"),
    ]
    for body, param in bodies:
        status, answer = send(server, "POST", "/v1/responses", body)
        assert 400 <= status < 500, (param, status, answer)
        assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["param"] == param
    for method, path in [("GET", "/v1/responses/resp_unknown"), ("POST", "/v1/responses/resp_unknown/cancel"),
                         ("GET", "/v1/responses/%00%ff")]:
        status, answer = send(server, method, path, b"{}" if method == "POST" else None)
        assert status == 404 and answer["error"]["code"] == "response_not_found", answer
    status, answer = send(server, "POST", "/v1/responses", json.dumps({"input": "Hi", "max_output_tokens": 2})
                          .encode())
    assert status == 200 and answer["status"] in ("completed", "incomplete")

"""The response's `reasoning` field (vLLM's current name) and its alias `reasoning_content`, and a tool call
after the reasoning, through a real server on the default model with `--reasoning-parser deepseek_r1`
and `--tool-call-parser mistral`, read by the official client.

What the model says is fixed by a regex (structured output, with `enable_in_reasoning` so the constraint
covers the reasoning too): the text holds a `</think>`, which the parser must take out, putting what
comes before it in `reasoning` and what follows in `content`, whole and streamed; then, with tools in
the request, a Mistral call, which the route must turn into `tool_calls`. Without a constraint the
model (which does not think) never writes `</think>`: deepseek_r1 reads its whole output as reasoning,
cut off before it finished.
"""

from __future__ import annotations

import json
import re

import openai
import pytest

from support.server import MODEL_NAME, start_server

pytestmark = pytest.mark.slow

REASONING = "Two plus two is four."
ANSWER = "The answer is 4."


def literal(text: str) -> str:
    """A regex matching exactly `text` (re.escape also escapes spaces, which xgrammar warns about)."""
    return re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text)


FORCED = {"structured_outputs": {"regex": literal(REASONING + "</think>" + ANSWER)}}
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def client(default_model_dir):
    server = start_server([str(default_model_dir), "--served-model-name", MODEL_NAME, "--max-model-len", "512",
                           "--kv-cache-memory-bytes", str(64 * 2**20),
                           "--reasoning-parser", "deepseek_r1", "--tool-call-parser", "mistral",
                           "--enable-auto-tool-choice",
                           "--structured-outputs-config", json.dumps({"enable_in_reasoning": True})])
    try:
        with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as client:
            yield client
    finally:
        assert server.stop() == 0, server.stderr()[-3000:]


def test_reasoning_and_its_alias_split_at_think_end_whole_and_streamed(client):
    raw = client.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=40,
                                                           temperature=0, extra_body=FORCED)
    message = json.loads(raw.text)["choices"][0]["message"]
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == (REASONING, REASONING, ANSWER)
    assert raw.parse().choices[0].message.reasoning == REASONING  # the client keeps the field

    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=40, temperature=0,
                                                 extra_body=FORCED, stream=True))
    deltas = [chunk.choices[0].delta.model_dump() for chunk in chunks if chunk.choices]
    streamed = {field: "".join(delta.get(field) or "" for delta in deltas)
                for field in ("reasoning", "reasoning_content", "content")}
    assert streamed == {"reasoning": REASONING, "reasoning_content": REASONING, "content": ANSWER}
    assert all(delta.get("reasoning") == delta.get("reasoning_content") for delta in deltas)
    assert not any("</think>" in (delta.get(field) or "") for delta in deltas for field in streamed)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_without_think_end_the_whole_output_is_reasoning(client):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0)
    message = response.choices[0].message
    assert message.content is None and message.reasoning and message.reasoning_content == message.reasoning
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                                 stream=True))
    streamed = "".join(chunk.choices[0].delta.model_dump().get("reasoning") or "" for chunk in chunks if chunk.choices)
    assert streamed == message.reasoning
    # An assistant turn sent back with `reasoning` (as a client copies it) is taken.
    follow_up = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=2, temperature=0,
        messages=[*MESSAGES, {"role": "assistant", "content": "4", "reasoning": message.reasoning},
                  {"role": "user", "content": "And 3 + 3?"}])
    assert follow_up.choices[0].message.reasoning


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALLING = {"structured_outputs": {"regex": literal('Let me check.</think>[TOOL_CALLS]get_weather{"city": "Paris"}')}}


def test_a_tool_call_after_the_reasoning_whole_and_streamed(client):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=64,
                                              temperature=0, extra_body=CALLING)
    choice = response.choices[0]
    assert (choice.message.reasoning, choice.message.content, choice.finish_reason) == ("Let me check.", None,
                                                                                        "tool_calls")
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)

    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=64,
                                                 temperature=0, extra_body=CALLING, stream=True))
    calls = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
    assert calls[0].id and calls[0].function.name == "get_weather" and all(c.index == 0 for c in calls)
    assert "".join(c.function.arguments or "" for c in calls) == '{"city": "Paris"}'
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# -- the same texts through the Responses API (serving_responses.py) ------------------------------------

RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]


def test_responses_give_a_reasoning_item_then_the_message(client):
    response = client.responses.create(model=MODEL_NAME, input=MESSAGES[0]["content"], max_output_tokens=40,
                                       temperature=0, extra_body=FORCED)
    reasoning, message = response.output
    assert (reasoning.type, reasoning.content[0].text, reasoning.summary) == ("reasoning", REASONING, [])
    assert (message.type, response.output_text) == ("message", ANSWER)


def test_responses_stream_the_reasoning_then_a_call_the_tool_parser_found(client):
    events = list(client.responses.create(model=MODEL_NAME, input=MESSAGES[0]["content"], tools=RESPONSES_TOOLS,
                                          max_output_tokens=64, temperature=0, extra_body=CALLING, stream=True))
    kinds = [event.type for event in events]
    reasoning_deltas = kinds.count("response.reasoning_text.delta")
    argument_deltas = kinds.count("response.function_call_arguments.delta")
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     *["response.reasoning_text.delta"] * reasoning_deltas, "response.reasoning_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", *["response.function_call_arguments.delta"] * argument_deltas,
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"] and reasoning_deltas >= 1 and argument_deltas >= 1
    reasoning, call = events[-1].response.output
    assert reasoning.content[0].text == "Let me check." == events[reasoning_deltas + 4].text
    assert (call.type, call.name, call.arguments) == ("function_call", "get_weather", '{"city": "Paris"}')

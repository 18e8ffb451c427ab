"""Agent loops through the real server (the shared default-model server): the assistant's tool call sent back
as clients send it (`content` null, or absent), the tool's result as a `tool` message, then the final answer,
with the official `openai` client and with LangChain's `ChatOpenAI.bind_tools` (issue 32, item 1).

The server has no --tool-call-parser (vLLM's deployments for agents have one), so the tool call is forced
by naming the function, and the final turn says tool_choice "none"; what is tested is the conversation
coming back. SmolLM2's template prints each message's content and nothing of tool calls: the assistant's
turn renders empty, as vLLM renders it (null content is "" for a string-content template)."""

from __future__ import annotations

import json
import sys
import urllib.request

import openai
import pytest

from support.pip_target import pip_target
from support.server import API_KEY, MODEL_NAME

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
                   "additionalProperties": False}}}
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
QUESTION = {"role": "user", "content": "What is the weather like in Paris today?"}
RESULT = "18 degrees and sunny"


@pytest.fixture(scope="module")
def client(smol_server):
    with openai.OpenAI(base_url=smol_server.base_url, api_key=API_KEY, max_retries=0, timeout=600) as client:
        yield client


def rendered(server, messages: list) -> str:
    """The prompt the server renders for `messages` (/tokenize, then /detokenize)."""
    def post(path: str, body: dict) -> dict:
        request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), headers={
            "Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())

    tokens = post("/tokenize", {"model": MODEL_NAME, "messages": messages})["tokens"]
    return post("/detokenize", {"model": MODEL_NAME, "tokens": tokens})["prompt"]


def test_a_tool_round_trip_with_the_official_client(client, smol_server):
    first = client.chat.completions.create(model=MODEL_NAME, messages=[QUESTION], tools=[WEATHER],
                                           tool_choice=FORCE_WEATHER, temperature=0, max_tokens=48)
    assistant = first.choices[0].message
    [call] = assistant.tool_calls
    assert assistant.content is None and call.function.name == "get_weather"
    assert "content" in assistant.model_dump(exclude_unset=True)  # the client sends it back as null
    messages = [QUESTION, assistant, {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    final = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=8)
    (choice,) = final.choices
    assert choice.message.content and not choice.message.tool_calls and choice.finish_reason in ("stop", "length")
    # What the template was given: the assistant's turn empty (null content is ""), the tool's result as text;
    # the same with the content left out (as some frameworks send it) and the result as a list of parts.
    as_sent = [QUESTION, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}, messages[2]]
    prompt = rendered(smol_server, as_sent)
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n" + RESULT + "<|im_end|>\n<|im_start|>assistant\n" \
        in prompt, prompt
    without_content = {"role": "assistant", "tool_calls": [call.model_dump()]}
    tool_parts = {"role": "tool", "tool_call_id": call.id, "content": [{"type": "text", "text": RESULT}]}
    assert rendered(smol_server, [QUESTION, without_content, tool_parts]) == prompt


# LangChain's OpenAI client and what it needs beyond the virtualenv, pinned: installed once (about 20 s) into a
# target under pip's cache, appended to sys.path (the virtualenv's openai, pydantic and httpx stay in charge).
LANGCHAIN = ["langchain-openai==1.8.1", "langchain-core==1.8.4", "langsmith==0.15.1", "langchain-protocol==0.0.20",
             "jsonpatch==1.48", "jsonpointer==3.12", "tenacity==9.2.1", "tiktoken==0.14.0", "uuid-utils==1.2.0",
             "orjson==3.13.0", "zstandard==0.25.0", "xxhash==4.1.0", "websockets==17.4", "requests-toolbelt==1.0.0",
             "distro==1.9.0"]


@pytest.fixture(scope="module")
def chat_openai(smol_server):
    """LangChain's ChatOpenAI on the server, given its max_tokens (which it sends as max_completion_tokens)."""
    target = str(pip_target("langchain-openai-1.8.1", LANGCHAIN, marker="langchain_openai/__init__.py"))
    sys.path.append(target)
    try:
        from langchain_openai import ChatOpenAI

        yield lambda max_tokens: ChatOpenAI(model=MODEL_NAME, base_url=smol_server.base_url, api_key=API_KEY,
                                            temperature=0, max_tokens=max_tokens, max_retries=0, timeout=600)
    finally:
        sys.path.remove(target)


def test_a_tool_round_trip_with_langchain_bind_tools(chat_openai):
    from langchain_core.messages import HumanMessage, ToolMessage

    question = HumanMessage(QUESTION["content"])
    called = chat_openai(48).bind_tools([WEATHER], tool_choice="get_weather").invoke([question])
    [call] = called.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str)
    # LangChain sends this AIMessage back with "content": null beside its tool_calls
    answer = chat_openai(8).bind_tools([WEATHER], tool_choice="none").invoke(
        [question, called, ToolMessage(RESULT, tool_call_id=call["id"])])
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls

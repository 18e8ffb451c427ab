"""Malformed and invalid requests: each gets the documented 4xx in OpenAI's error shape, naming the
parameter, and the server serves a valid request right after every one of them.

Server logic, so in-process (tests/support/in_process_server.py: Quart's test client over the app of
`asyncengine serve` and an AsyncEngine on the tiny Llama with a byte-level tokenizer, an API key, a
512-token context). The same oversized body over a real socket, where the server answers 413 before
reading it all and closes the connection, is tests/server/test_http_hardening.py's."""

from __future__ import annotations

import json
import shutil

import pytest

from asyncengine.server.config import ServerConfig
from support.in_process_server import in_process_server
from support.server import API_KEY, MODEL_NAME
from support.tiny_tokenizer import save_tiny_tokenizer

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
CHAT = [{"role": "user", "content": "Hi"}]
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("bad-requests") / "llama"
    shutil.copytree(tiny_model("llama").path, directory)  # a copy: the shared tiny model stays tokenizer-less
    save_tiny_tokenizer(directory)
    with in_process_server({"model": str(directory), "served_model_name": MODEL_NAME, "max_model_len": MAX_MODEL_LEN,
                            "kv_cache_memory_bytes": 8 * 2**20}, ServerConfig(api_key=API_KEY)) as running:
        yield running


def send(server, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None):
    return server.request(method, path, body, AUTH if headers is None else headers)


def completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 2, **fields}


LONG_PROMPT = "word " * 9000  # more tokens than the context (MAX_MODEL_LEN)

# (name, method, path, body, headers or None for the valid key, status, param, words the message must hold)
CASES = [
    ("broken JSON", "POST", "/v1/completions", b'{"prompt": "Hi",', None, 400, None, "not valid JSON"),
    ("not an object", "POST", "/v1/completions", b'["Hi"]', None, 400, None, "Expected `object`"),
    ("empty body", "POST", "/v1/completions", b"", None, 400, None, "no body"),
    ("max_tokens of the wrong type", "POST", "/v1/completions", completion(max_tokens="ten"), None, 400,
     "max_tokens", "Expected `int | null`"),
    ("negative max_tokens", "POST", "/v1/completions", completion(max_tokens=-5), None, 400, "max_tokens",
     "at least 1"),
    ("negative temperature", "POST", "/v1/completions", completion(temperature=-1), None, 400, "temperature",
     "temperature"),
    ("top_p out of range", "POST", "/v1/completions", completion(top_p=1.5), None, 400, "top_p", "top_p"),
    ("n of zero", "POST", "/v1/completions", completion(n=0), None, 400, "n", "n must be"),
    ("too many logprobs", "POST", "/v1/completions", completion(logprobs=50), None, 400, "logprobs", "logprobs"),
    ("prompt over the context", "POST", "/v1/completions", completion(prompt=LONG_PROMPT), None, 400, "prompt",
     "max_model_len"),
    ("max_tokens past the context", "POST", "/v1/completions", completion(max_tokens=9000), None, 400, "max_tokens",
     "maximum context length"),
    ("prompt of the wrong shape", "POST", "/v1/completions", completion(prompt=[1, "a"]), None, 400, "prompt",
     "prompt must be"),
    ("token id outside the vocabulary", "POST", "/v1/completions", completion(prompt=[1, 10**9]), None, 400,
     "prompt[1]", "outside the vocabulary"),
    ("unknown model", "POST", "/v1/completions", completion(model="gpt-4"), None, 404, "model", "does not exist"),
    ("unknown model on /tokenize", "POST", "/tokenize", {"model": "gpt-4", "prompt": "hi"}, None, 404, "model",
     "does not exist"),
    # An unknown top-level field is ignored (tests/server/test_ignored_and_vllm_fields.py); inside an object, a 400.
    ("unknown nested parameter", "POST", "/v1/completions", completion(stream_options={"frobnicate": True}), None,
     400, "stream_options.frobnicate", "unsupported parameter"),
    ("unsupported parameter: echo with logprobs", "POST", "/v1/completions", completion(echo=True, logprobs=1), None,
     400, "echo", "not supported"),
    # vLLM's fields, implemented, still validated (docs/server.md, "Fields").
    ("priority without --scheduling-policy priority", "POST", "/v1/completions", completion(priority=1), None, 400,
     "priority", "--scheduling-policy priority"),
    ("chat_template without --trust-request-chat-template", "POST", "/v1/chat/completions",
     chat(chat_template="{{ messages[0]['content'] }}"), None, 400, "chat_template", "--trust-request-chat-template"),
    ("truncate_prompt_tokens of zero", "POST", "/v1/completions", completion(truncate_prompt_tokens=0), None, 400,
     "truncate_prompt_tokens", "truncate_prompt_tokens"),
    ("truncate_prompt_tokens past the context", "POST", "/v1/completions", completion(truncate_prompt_tokens=600),
     None, 400, "truncate_prompt_tokens", "max_model_len"),
    ("empty cache_salt", "POST", "/v1/completions", completion(cache_salt=""), None, 400, "cache_salt", "at least 1"),
    ("guided_choice beside structured_outputs", "POST", "/v1/completions",
     completion(guided_choice=["a"], structured_outputs={"choice": ["b"]}), None, 400, "guided_choice", "send one"),
    ("guided_choice of the wrong type", "POST", "/v1/completions", completion(guided_choice="a"), None, 400,
     "guided_choice", "Expected"),
    ("guided_regex that is not a regex", "POST", "/v1/completions", completion(guided_regex="(("), None, 400,
     "guided_regex", "regex"),
    ("store of the wrong type", "POST", "/v1/chat/completions", chat(store="yes"), None, 400, "store", "Expected"),
    ("logit_bias out of range", "POST", "/v1/completions", completion(logit_bias={"5": 101}), None, 400,
     "logit_bias", "at most 100"),
    ("missing messages", "POST", "/v1/chat/completions", {"model": MODEL_NAME}, None, 400, "messages",
     "missing required"),
    ("a message without a role", "POST", "/v1/chat/completions", chat(messages=[{"content": "x"}]), None, 400,
     "messages[0].role", "missing required"),
    ("an image content part", "POST", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), None, 400,
     "messages[0].content[0].type", "not supported"),
    ("an unknown response_format type", "POST", "/v1/chat/completions", chat(response_format={"type": "xml"}), None,
     400, "response_format", "not supported"),
    ("tools without a tool parser", "POST", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f"}}]), None, 400, "tools", "--enable-auto-tool-choice"),
    ("top_logprobs without logprobs", "POST", "/v1/chat/completions", chat(top_logprobs=2), None, 400,
     "top_logprobs", "needs logprobs"),
    ("stream_options of the wrong type", "POST", "/v1/chat/completions", chat(stream=True, stream_options=5), None,
     400, "stream_options", "Expected"),
    ("missing API key", "POST", "/v1/completions", completion(), {"Content-Type": "application/json"}, 401, None,
     "API key"),
    ("wrong API key", "POST", "/v1/completions", completion(),
     {"Authorization": "Bearer nope", "Content-Type": "application/json"}, 401, None, "API key"),
    ("oversized body", "POST", "/v1/completions", completion(prompt="a" * (3 * 2**20)), None, 413, None,
     "larger than the limit"),
    ("unknown route", "GET", "/v1/engines", None, None, 404, None, "not found"),
    ("wrong method", "GET", "/v1/completions", None, None, 405, None, "not allowed"),
    ("detokenize outside the vocabulary", "POST", "/detokenize", {"tokens": [10**9]}, None, 400, "tokens[0]",
     "outside the vocabulary"),
    # Issue 13: every field bounded at the edge (docs/server.md, "Limits"). On main, the two top_k cases
    # killed the worker ("Overflow when unpacking long long") and every later request got 503.
    ("top_k past int64", "POST", "/v1/completions", completion(top_k=2**63), None, 400, "top_k", "top_k"),
    ("top_k 2^64-1 in chat", "POST", "/v1/chat/completions", chat(top_k=2**64 - 1), None, 400, "top_k", "top_k"),
    ("seed past 64 bits", "POST", "/v1/completions", completion(seed=2**64), None, 400, "seed", "seed"),
    ("n above --max-n", "POST", "/v1/completions", completion(n=4096), None, 400, "n", "max_n=128"),
    ("min_tokens past the context", "POST", "/v1/chat/completions",
     {"model": MODEL_NAME, "messages": CHAT, "min_tokens": 2**62}, None, 400, "min_tokens", "maximum context length"),
    ("min_tokens past the room the prompt leaves", "POST", "/v1/chat/completions",
     {"model": MODEL_NAME, "messages": CHAT, "min_tokens": MAX_MODEL_LEN}, None, 400, "min_tokens", "room for"),
    ("tools not a list", "POST", "/v1/chat/completions", chat(tools="notalist"), None, 400, "tools", "array"),
    ("a prompt nested 10,000 deep", "POST", "/v1/completions",
     b'{"model": "%s", "prompt": %s%s}' % (MODEL_NAME.encode(), b"[" * 10_000, b"]" * 10_000), None, 400,
     "prompt[0][0]", "Expected `int`"),
    ("a field typed Any nested 10,000 deep", "POST", "/v1/chat/completions",
     b'{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "tool_choice": %s%s}'
     % (MODEL_NAME.encode(), b"[" * 10_000, b"]" * 10_000), None, 400, "tool_choice", "too deeply"),
]


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_bad_request_gets_its_error_and_the_server_goes_on(server, case):
    _, method, path, body, headers, status, param, words = case
    got_status, got_headers, raw = send(server, method, path, body, headers)
    assert got_status == status, raw
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert words.lower() in error["message"].lower(), error["message"]
    assert got_headers["content-type"] == "application/json"
    # ... and a valid request right after it is served.
    ok_status, _, ok_raw = send(server, "POST", "/v1/completions", completion(temperature=0))
    assert ok_status == 200, ok_raw
    assert json.loads(ok_raw)["usage"]["completion_tokens"] == 2


def test_routes_outside_v1_need_no_key_but_v1_does(server):
    assert send(server, "GET", "/health", headers={})[0] == 200
    assert send(server, "GET", "/metrics", headers={})[0] == 200
    assert send(server, "GET", "/v1/models", headers={})[0] == 401

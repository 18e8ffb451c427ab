"""The request fields of issue 32, point 2 (docs/server.md, "Fields"): every one sent with a valid value to a
real `asyncengine serve` is accepted; each that has no effect here is named in `X-Ignored-Fields` (streamed
responses too), as is an unknown field; each implemented one changes the output as documented (`echo`,
`priority` order under load, `cache_salt` prefix isolation, a per-request `chat_template` and `documents`,
`truncate_prompt_tokens`, `return_tokens_as_token_ids`, the `guided_*` aliases, /tokenize's
`return_token_strs`). `--strict-request-fields` makes an unknown field a 400 (in-process: server logic).

One real server for the module: the default model, `--scheduling-policy priority --max-num-seqs 1` (so that
requests queue, one at a time, in priority order), `--trust-request-chat-template` and
`--enable-prompt-tokens-details` (usage's cached tokens show prefix-cache hits). The rate limit of the
warning and the header's sanitizing are pure logic, tested in-process.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import shutil
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import jsonschema
import msgspec
import pytest

from asyncengine.server import request_fields
from asyncengine.server.config import ServerConfig
from asyncengine.server.protocol import ChatCompletionRequest
from support.in_process_server import in_process_server
from support.server import MODEL_NAME, metric, start_server
from support.tiny_tokenizer import save_tiny_tokenizer

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Say hi"}]
# A template of our own: what the prompt becomes is known exactly, so its token count is too.
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
DOC_TEMPLATE = "{% for d in documents %}<doc>{{ d['text'] }}</doc>{% endfor %}{{ messages[-1]['content'] }}"


@pytest.fixture(scope="module")
def server(default_model_dir):
    running = start_server([str(default_model_dir), "--served-model-name", MODEL_NAME, "--scheduling-policy",
                            "priority", "--max-num-seqs", "1", "--max-model-len", "1024", "--trust-request-chat-template",
                            "--enable-prompt-tokens-details", "--kv-cache-memory-bytes", str(256 * 2**20)],
                           timeout=600)  # a loaded machine starts it slowly
    yield running
    assert running.stop() == 0, running.stderr()[-3000:]


def post(server, path: str, body: dict) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()


def completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 3, "temperature": 0, **fields}


def tokens_of(server, text: str) -> int:
    status, _, body = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert status == 200, body
    return json.loads(body)["count"]


def text_of(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


# -- what each implemented field does (answer: the 200's JSON) ------------------------------------------


def echoes_the_prompt(server, answer):
    assert text_of(answer).startswith(PROMPT) and len(text_of(answer)) > len(PROMPT)


def renders_the_request_template(server, answer):
    assert answer["usage"]["prompt_tokens"] == tokens_of(server, "[user] Say hi\n[assistant]")


def renders_the_documents(server, answer):
    assert answer["usage"]["prompt_tokens"] == tokens_of(server, "<doc>Paris is in France</doc>Say hi")


def keeps_the_last_two_tokens(server, answer):
    assert answer["usage"]["prompt_tokens"] == 2


def logprob_tokens_are_ids(server, answer):
    logprobs = answer["choices"][0]["logprobs"]
    tokens = logprobs["tokens"] if "tokens" in logprobs else [t["token"] for t in logprobs["content"]]
    assert tokens and all(re.fullmatch(r"token_id:\d+", token) for token in tokens), tokens


def one_of_the_choices(server, answer):
    assert text_of(answer) in ("yes", "no")


def three_digits(server, answer):
    assert re.fullmatch(r"[0-9]{3}", text_of(answer)), text_of(answer)


def json_of_the_schema(server, answer):
    jsonschema.validate(json.loads(text_of(answer)), {"enum": ["red", "green"]})


def of_the_grammar(server, answer):
    assert text_of(answer) in ("hi", "ho")


def accepted(server, answer):  # its effect is tested below (priority order, prefix isolation)
    assert answer["choices"]


# (path, fields sent, effect: None for a field without effect here, which X-Ignored-Fields must name)
FIELDS = [
    # OpenAI's fields without effect here
    *[("/v1/chat/completions", {name: value}, None) for name, value in [
        ("store", True), ("metadata", {"k": "v"}), ("reasoning_effort", "low"), ("service_tier", "auto"),
        ("modalities", ["text"]), ("verbosity", "low"), ("prompt_cache_key", "key-1"), ("safety_identifier", "s-1"),
        ("functions", [{"name": "f", "parameters": {"type": "object"}}]), ("function_call", "auto"),
        ("user", "u-1"), ("parallel_tool_calls", True), ("audio", {"voice": "alloy", "format": "mp3"}),
        ("prediction", {"type": "content", "content": "x"}), ("web_search_options", {}),
        ("frobnicate", 1)]],  # unknown
    *[("/v1/completions", {name: value}, None) for name, value in [
        ("store", True), ("metadata", {"k": "v"}), ("service_tier", "auto"), ("prompt_cache_key", "key-1"),
        ("safety_identifier", "s-1"), ("user", "u-1"), ("frobnicate", 1)]],
    ("/tokenize", {"prompt": "Hi", "frobnicate": 1}, None),
    # vLLM's, implemented
    ("/v1/completions", {"echo": True}, echoes_the_prompt),
    ("/v1/completions", {"priority": 3}, accepted),
    ("/v1/chat/completions", {"priority": -2}, accepted),
    ("/v1/completions", {"cache_salt": "tenant-a"}, accepted),
    ("/v1/chat/completions", {"cache_salt": "tenant-a"}, accepted),
    ("/v1/chat/completions", {"chat_template": TEMPLATE}, renders_the_request_template),
    ("/v1/chat/completions", {"chat_template": DOC_TEMPLATE, "documents": [{"text": "Paris is in France"}]},
     renders_the_documents),
    ("/v1/completions", {"truncate_prompt_tokens": 2}, keeps_the_last_two_tokens),
    ("/v1/chat/completions", {"truncate_prompt_tokens": 2}, keeps_the_last_two_tokens),
    ("/v1/completions", {"return_tokens_as_token_ids": True, "logprobs": 1}, logprob_tokens_are_ids),
    ("/v1/chat/completions", {"return_tokens_as_token_ids": True, "logprobs": True}, logprob_tokens_are_ids),
    ("/v1/chat/completions", {"guided_choice": ["yes", "no"], "max_tokens": 5}, one_of_the_choices),
    ("/v1/completions", {"guided_regex": "[0-9]{3}", "max_tokens": 6}, three_digits),
    ("/v1/completions", {"guided_json": {"enum": ["red", "green"]}, "max_tokens": 8}, json_of_the_schema),
    ("/v1/completions", {"guided_json": '{"enum": ["red", "green"]}', "max_tokens": 8}, json_of_the_schema),
    ("/v1/completions", {"guided_grammar": 'root ::= "hi" | "ho"', "max_tokens": 4}, of_the_grammar),
]


@pytest.mark.parametrize("path,fields,effect", FIELDS,
                         ids=[f"{path} {','.join(fields)}" for path, fields, _ in FIELDS])
def test_every_field_is_accepted_and_ignored_or_honoured(server, path, fields, effect):
    body = fields if path == "/tokenize" else (chat if "chat" in path else completion)(**fields)
    status, headers, raw = post(server, path, body)
    assert status == 200, raw
    ignored = [name.strip() for name in headers.get("x-ignored-fields", "").split(",") if name.strip()]
    if effect is None:
        assert [name for name in fields if name not in ("prompt",)] == ignored, headers
    else:
        assert ignored == [], f"{fields} is implemented, yet listed as ignored: {ignored}"
        effect(server, json.loads(raw))


def test_a_streamed_response_names_its_ignored_fields_too(server):
    status, headers, raw = post(server, "/v1/chat/completions", chat(stream=True, store=True, frobnicate=1))
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert headers["x-ignored-fields"] == "frobnicate, store"
    assert raw.rstrip().endswith(b"data: [DONE]")


def test_an_unknown_field_is_logged_once(server):
    post(server, "/v1/completions", completion(zzz_unknown_once=1))
    post(server, "/v1/completions", completion(zzz_unknown_once=2))
    deadline = time.monotonic() + 10
    while "zzz_unknown_once" not in server.stderr() and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = [line for line in server.stderr().splitlines() if "zzz_unknown_once" in line]
    assert len(lines) == 1 and "WARNING" in lines[0], lines


def test_echo_of_token_ids_and_with_truncation(server):
    status, _, raw = post(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    ids = json.loads(raw)["tokens"]
    _, _, raw = post(server, "/v1/completions", completion(prompt=ids, echo=True))
    assert text_of(json.loads(raw)).startswith(PROMPT)
    _, _, raw = post(server, "/v1/completions", completion(echo=True, truncate_prompt_tokens=2))
    _, _, detok = post(server, "/detokenize", {"tokens": ids[-2:]})
    answer = json.loads(raw)
    assert answer["usage"]["prompt_tokens"] == 2
    assert text_of(answer).startswith(json.loads(detok)["prompt"])
    # streamed: the prompt in the first chunk
    _, _, raw = post(server, "/v1/completions", completion(echo=True, stream=True))
    chunks = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]).count(PROMPT) == 1


def test_tokenize_returns_token_strs(server):
    status, headers, raw = post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    answer = json.loads(raw)
    assert status == 200 and "x-ignored-fields" not in headers
    assert len(answer["token_strs"]) == answer["count"] and answer["count"] >= 2
    assert "".join(answer["token_strs"]).replace("Ġ", " ").endswith("Hello world")  # the tokenizer's own pieces


def test_priority_orders_the_queue_under_load(server):
    # One slot (--max-num-seqs 1): a streamed request holds it while five queue, each sent once the one
    # before waits (so their arrival order is known); then the client drops the stream, which aborts it, and
    # the five run lowest value first, ties by arrival. (Dropping it, rather than waiting for it to end,
    # makes the test independent of the machine's speed.)
    finished: list[str] = []
    lock = threading.Lock()

    def send(name: str, body: dict) -> None:
        status, _, raw = post(server, "/v1/completions", body)
        assert status == 200, raw
        with lock:
            finished.append(name)

    url = urllib.parse.urlsplit(server.url)
    blocker = http.client.HTTPConnection(url.hostname, url.port, timeout=300)
    blocker.request("POST", "/v1/completions", body=json.dumps(completion(max_tokens=900, ignore_eos=True,
                                                                          stream=True)),
                    headers={"Content-Type": "application/json"})
    assert blocker.getresponse().status == 200  # the headers come with its first token: it holds the slot
    queued = [("p5", 5), ("p1-first", 1), ("p3", 3), ("p1-second", 1), ("p0", 0)]
    threads = []
    for count, (name, priority) in enumerate(queued, start=1):
        thread = threading.Thread(target=send, args=(name, completion(priority=priority, max_tokens=2)))
        thread.start()
        threads.append(thread)
        assert wait_for(lambda: metric(server, "num_requests_waiting") == count), f"request {name} did not queue"
    assert metric(server, "num_requests_running") == 1 and finished == []
    blocker.close()  # the stream's request is aborted: the slot goes to the queue
    for thread in threads:
        thread.join(300)
    assert finished == ["p0", "p1-first", "p1-second", "p3", "p5"]


def test_cache_salt_isolates_prefixes(server):
    prompt = "Salted prefix test: " + " ".join(f"word{i}" for i in range(80))  # many full blocks

    def cached(**fields) -> int:
        status, _, raw = post(server, "/v1/completions", completion(prompt=prompt, max_tokens=1, **fields))
        assert status == 200, raw
        return json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(cache_salt="alice")  # fills the cache under alice's salt
    assert cached(cache_salt="alice") > 64  # the same salt: its blocks are found
    assert cached(cache_salt="bob") == 0  # another salt shares nothing
    assert cached() == 0  # nor does no salt
    assert cached() > 64  # (which is cached on its own from now on)


def wait_for(condition, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


# -- in-process: strict mode, the header, the warning's rate limit ---------------------------------------


def test_strict_request_fields_refuses_an_unknown_field(tiny_model, tmp_path):
    directory = tmp_path / "llama"
    shutil.copytree(tiny_model("llama").path, directory)
    save_tiny_tokenizer(directory)
    body = {"prompt": "Hi", "max_tokens": 1}
    with in_process_server({"model": str(directory), "max_model_len": 128, "kv_cache_memory_bytes": 4 * 2**20},
                           ServerConfig(strict_request_fields=True)) as strict:
        json_type = {"Content-Type": "application/json"}
        status, _, raw = strict.request("POST", "/v1/completions", {**body, "frobnicate": 1}, json_type)
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == "frobnicate" and error["code"] == "unsupported_parameter"
        # OpenAI's known fields are not unknown: still accepted, and named as ignored
        status, headers, raw = strict.request("POST", "/v1/completions", {**body, "user": "u"}, json_type)
        assert status == 200 and headers["x-ignored-fields"] == "user", raw
        status, _, raw = strict.request("GET", "/openapi.json")
        assert json.loads(raw)["components"]["schemas"]["CompletionRequest"]["additionalProperties"] is False


def test_decode_ignores_only_top_level_unknown_fields():
    body = json.dumps({"messages": [{"role": "user", "content": "x"}], "zz": 1, "aa": {"b": 2}}).encode()
    request, unknown = request_fields.decode(body, ChatCompletionRequest, strict=False)
    assert unknown == ["zz", "aa"] and request.messages[0].content == "x"
    with pytest.raises(msgspec.ValidationError, match="zz"):
        request_fields.decode(body, ChatCompletionRequest, strict=True)
    nested = json.dumps({"messages": [{"role": "user", "content": "x"}], "stream_options": {"zz": 1}}).encode()
    with pytest.raises(msgspec.ValidationError, match=r"stream_options"):
        request_fields.decode(nested, ChatCompletionRequest, strict=False)
    wrong = json.dumps({"messages": [{"role": "user", "content": "x"}], "zz": 1, "store": "yes"}).encode()
    with pytest.raises(msgspec.ValidationError, match=r"store"):  # a known field keeps its type
        request_fields.decode(wrong, ChatCompletionRequest, strict=False)


def test_the_header_carries_only_safe_names_and_says_how_many_it_left_out():
    assert request_fields.header_value([]) is None
    assert request_fields.header_value(["a", "b.c", "a"]) == "a, b.c"
    assert request_fields.header_value(["ok", "bad\r\nX-Injected: 1", "é", "x" * 65]) == "ok, +3"
    many = [f"f{i}" for i in range(40)]
    assert request_fields.header_value(many) == ", ".join(many[:32]) + ", +8"


def test_the_warning_is_rate_limited_per_name(caplog, monkeypatch):
    monkeypatch.setattr(request_fields, "_last_warned", type(request_fields._last_warned)())
    clock = [1000.0]
    monkeypatch.setattr(request_fields.time, "monotonic", lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger="asyncengine.server.fields"):
        request_fields.warn_unknown(["a", "b"], "/v1/completions")
        request_fields.warn_unknown(["a"], "/v1/completions")
        clock[0] += request_fields.WARN_INTERVAL_S + 1
        request_fields.warn_unknown(["a"], "/v1/completions")
    assert [record.getMessage().split("'")[1] for record in caplog.records] == ["a", "b", "a"]
    for index in range(request_fields._MAX_REMEMBERED + 10):  # a client inventing names cannot grow the memory
        request_fields.warn_unknown([f"n{index}"], "/v1/completions")
    assert len(request_fields._last_warned) == request_fields._MAX_REMEMBERED

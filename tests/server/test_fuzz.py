"""Property-based fuzzing of a real `asyncengine serve` (issue 13, acceptance 2).

Request bodies are drawn by hypothesis from the JSON schemas of the server's own `GET /openapi.json`
(tests/support/schema_fuzz.py: mostly valid bodies with fields at their extremes, wrong types, deep
nesting, unicode, missing and unknown fields), with a fixed seed, for /v1/completions and
/v1/chat/completions (streamed and not; `tool_choice` none, auto, required and named, with tools),
/tokenize and /detokenize, the render routes /v1/completions/render and /v1/chat/completions/render (the
request rendered and tokenized, not run), the pooling routes /v1/embeddings, /pooling, /score, /v1/score (vLLM's
pair names), /rerank, /v2/rerank and Cohere's /v2/embed (`dimensions`, `truncate_prompt_tokens`, `input` lists; a
generation model embeds with its last token), SageMaker's /invocations (each route's bodies, routed by their
fields) and POST /ping (any body: no body is read), and the runtime
LoRA routes /v1/load_lora_adapter and /v1/unload_lora_adapter, with adapters that load, that do not, and one whose matrices do not fit
the model, which requests then name as their `model`; OpenAI's Responses API, /v1/responses (input
items of every kind, tools, text.format, background, store, streamed as typed events); issue 32's request
fields (`priority` under --scheduling-policy priority, `cache_salt`, `echo`, a request's `chat_template` with
--trust-request-chat-template, `documents`, `truncate_prompt_tokens`, `return_tokens_as_token_ids`, the
`guided_*` aliases, OpenAI's ignored fields and unknown ones). The server runs a tiny random-weight model with a
byte-level tokenizer and a 64-token context, so that what a valid request generates is short. The cases go
two at a time, concurrently, each pair followed by a normal request.
Properties, for every case:

- no 5xx but a 503 for overload (`engine_overloaded`); no error event mid-stream that is internal or
  says the engine died;
- every 4xx (and that 503) is OpenAI's error shape, exactly `{"error": {"message", "type", "param", "code"}}`,
  with a message that names no Python exception class and holds no traceback;
- every 200 matches the response schema the document gives (each stream event the event schema; the LoRA
  routes answer text);
- the server then answers a normal request.

At the end no request is running and the KV cache is empty.
"""

from __future__ import annotations

import collections
import concurrent.futures
import http.client
import json
import re
import shutil
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from support.schema_fuzz import DANGEROUS_INTS, SchemaStrategies, encode_body
from support.server import metric, start_server
from support.tiny_tokenizer import save_tiny_tokenizer


API_KEY = "fuzz-key"
MAX_MODEL_LEN = 64
LORA_RANK = 4
SERVER_OPTIONS = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4", "--max-waiting-requests", "16",
                  "--kv-cache-memory-bytes", str(4 * 2**20), "--api-key", API_KEY, "--served-model-name", "tiny",
                  "--enable-lora", "--max-lora-rank", str(LORA_RANK), "--max-loras", "2",
                  "--enable-runtime-lora-updates", "--scheduling-policy", "priority", "--trust-request-chat-template",
                  "--enable-prompt-tokens-details"]
HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
ROUTES = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest",
          "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest",
          "/v1/embeddings": "EmbeddingRequest", "/pooling": "PoolingRequest", "/score": "ScoreRequest",
          "/rerank": "RerankRequest", "/v1/score": "ScoreRequest", "/v2/rerank": "RerankRequest",
          "/v2/embed": "CohereEmbedRequest", "/invocations": None, "/ping": None,
          "/v1/completions/render": "CompletionRequest", "/v1/chat/completions/render": "ChatCompletionRequest",
          "/v1/load_lora_adapter": "LoadLoRAAdapterRequest", "/v1/unload_lora_adapter": "UnloadLoRAAdapterRequest",
          "/v1/responses": "ResponsesRequest"}
# Routes whose 200 is plain text (vLLM's answers of the runtime LoRA routes).
TEXT_ROUTES = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/ping"}
# Examples whose first case is drawn for one route (the second from every route).
EXAMPLES_PER_ROUTE = 14  # 364 cases over the first 13 routes (320 before the render and Responses routes joined)
# Fewer for the routes whose code another route's cases already reach (/v1/score is /score's view, /v2/rerank
# /rerank's, /invocations each route's; /ping reads no body): with /v2/embed's 14, 70 more cases, 434 in all.
# More for /pooling: its request declares many optional fields that a generation model refuses when set
# (`dimensions`, ...), so few drawn bodies are valid, and a valid one must get through (asserted below).
FEWER_EXAMPLES = {"/v1/score": 4, "/v2/rerank": 4, "/invocations": 10, "/ping": 3, "/pooling": 28}
ADAPTER_NAMES = ["a", "b", "misfit", "tiny"]  # "tiny": the served model's own name
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
    {"type": "function", "function": {"name": "g"}}]
# The same tools in the Responses API's flat shape.
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
# How a Responses stream may end (there is no [DONE]).
RESPONSES_ENDS = {"response.completed", "response.incomplete", "response.failed"}
# An exception's class name or a traceback in an error message: internals, not what the client did wrong.
PYTHON_INTERNALS = re.compile(r"Traceback|File \"|\b[A-Z][A-Za-z]*(?:Error|Exception)\b")
NORMAL_REQUEST = ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 1})


def save_adapter(directory, *, hidden: int, out: int, seed: int) -> str:
    """A PEFT LoRA adapter on q_proj of both layers, written by hand (rank LORA_RANK); `out` other than the
    model's q_proj width makes one whose matrices do not fit (its config reads as valid)."""
    from safetensors.torch import save_file

    directory.mkdir()
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in (0, 1):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(LORA_RANK, hidden, generator=generator)
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, LORA_RANK, generator=generator)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": LORA_RANK, "lora_alpha": 8, "target_modules": ["q_proj"], "bias": "none"}))
    return str(directory)


@pytest.fixture(scope="module")
def lora_paths(tiny_model, tmp_path_factory) -> list[str]:
    """Paths a load request may name: two adapters that load, one whose matrices do not fit, the model's own
    directory (no adapter), a missing one, and odd strings."""
    llama = tiny_model("llama")
    hidden = llama.hf_model.config.hidden_size
    root = tmp_path_factory.mktemp("fuzz-adapters")
    return [save_adapter(root / "a", hidden=hidden, out=hidden, seed=1),
            save_adapter(root / "b", hidden=hidden, out=hidden, seed=2),
            save_adapter(root / "misfit", hidden=hidden, out=hidden + 5, seed=3),
            str(llama.path), str(root / "missing"), "", "/", "\x00", "a" * 5000]


@pytest.fixture(scope="module")
def fuzz_server(tiny_model, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("fuzz") / "llama"
    shutil.copytree(tiny_model("llama").path, model_dir)  # a copy: the shared tiny model stays tokenizer-less
    save_tiny_tokenizer(model_dir)
    server = start_server([str(model_dir), *SERVER_OPTIONS])
    yield server
    assert server.stop() == 0, server.stderr()[-3000:]


@pytest.fixture(scope="module")
def document(fuzz_server) -> dict[str, Any]:
    status, _, body = send(fuzz_server, "GET", "/openapi.json")
    assert status == 200, body[:500]
    return json.loads(body)


# -- sending ------------------------------------------------------------------------------------------


def send(server, method: str, path: str, body: bytes | None = None) -> tuple[int, str, bytes]:
    """(status, content type, body) of one request on its own connection."""
    url = urllib.parse.urlsplit(server.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    try:
        connection.request(method, path, body=body, headers=HEADERS)
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        connection.close()


# -- cases --------------------------------------------------------------------------------------------


@dataclass
class Case:
    path: str
    body: Any  # JSON-able, with support.schema_fuzz.Raw values in it

    def __repr__(self) -> str:  # a falsifying example stays readable whatever its size
        text = repr(self.body)
        return f"Case({self.path!r}, {text[:600] + ' ...' if len(text) > 600 else text})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # hypothesis' printer, which skips a dataclass' repr
        printer.text(repr(self))


def cases(document: dict[str, Any], lora_paths: list[str], only: str | None = None) -> st.SearchStrategy[Case]:
    """Bodies for every fuzzed route, or for the route `only`."""
    components = document["components"]["schemas"]
    token_ids = st.lists(st.integers(3, 258), min_size=1, max_size=8)
    odd_token_ids = st.lists(st.sampled_from(DANGEROUS_INTS), min_size=1, max_size=3)
    text = st.text(max_size=20)
    prompt = st.one_of(text, st.lists(text, min_size=1, max_size=4), token_ids, st.lists(token_ids, min_size=1,
                                                                                         max_size=4))
    roles = st.sampled_from(["user", "assistant", "system", "tool", "developer"])
    pooling_input = st.one_of(text, st.lists(text, min_size=1, max_size=4), token_ids,
                              st.lists(token_ids, min_size=1, max_size=4), odd_token_ids)
    hints = {
        # Typed Any in the schema (several shapes, checked by hand): the shapes clients send.
        "prompt": st.one_of(prompt, odd_token_ids, st.lists(odd_token_ids, max_size=3)),
        "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}},
                                        {"type": "function", "function": {"name": "g"}},
                                        {"type": "function", "function": {"name": "unknown"}}]),
        "tools": st.sampled_from([TOOLS, TOOLS[:1], TOOLS[1:], []]),
        "role": roles,
        # Names the server knows (the model, adapters loaded or not), so that requests reach what serves them.
        "model": st.sampled_from([*ADAPTER_NAMES, "unknown"]),
        "lora_name": st.sampled_from(ADAPTER_NAMES),
        "lora_path": st.sampled_from(lora_paths),
        "input": pooling_input,
        "text_1": st.one_of(text, st.lists(text, min_size=1, max_size=3)),
        "text_2": st.one_of(text, st.lists(text, min_size=1, max_size=3)),
        "queries": st.one_of(text, st.lists(text, min_size=1, max_size=3)),
        "items": st.one_of(text, st.lists(text, min_size=1, max_size=3)),
        "texts": st.lists(text, max_size=3),
        # /rerank's documents are strings, chat's are objects for the template.
        "documents": st.one_of(st.lists(text, max_size=3), st.lists(st.fixed_dictionaries({"text": text}), max_size=2)),
        # Issue 32's fields: templates that render, fail to parse or fail on the data; constraints of each kind.
        "chat_template": st.sampled_from(["{{ messages[0]['content'] }}", "{% for d in documents %}{{ d.text }}"
                                          "{% endfor %}", "{{ broken", "{{ raise_exception('no') }}", "{{ 1 / 0 }}",
                                          "{{ messages.missing.deeper }}", ""]),
        "guided_json": st.sampled_from([{"enum": ["a", "b"]}, {"type": "object"}, '{"type": "string"}', "not json",
                                        {"type": "nonsense"}, 5]),
        "guided_regex": st.sampled_from(["[a-z]{2}", "((", "a*", ""]),
        "guided_choice": st.one_of(st.lists(text, max_size=3)),
        "guided_grammar": st.sampled_from(['root ::= "x"', "root ::= root", "not a grammar"]),
        "cache_salt": st.one_of(text, st.just("")),
    }
    schemas = SchemaStrategies(components, hints)
    message = st.fixed_dictionaries({"role": roles, "content": text})
    messages = st.lists(message, min_size=1, max_size=3)
    small = st.integers(1, 4)
    stream = st.sampled_from([{}, {}, {"stream": True}])
    lora_name, lora_path = st.sampled_from(ADAPTER_NAMES), st.sampled_from(lora_paths)
    # tool_choice "required" and named functions force the tool calls' schema (structured output).
    tooling = st.sampled_from([{}, {}, {"tools": TOOLS, "tool_choice": "auto"},
                               {"tools": TOOLS, "tool_choice": "required"},
                               {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
                               {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}}])
    bases = {
        "/v1/completions": st.builds(lambda p, m, s: {"prompt": p, "max_tokens": m, **s}, prompt, small,
                                     stream),
        "/v1/chat/completions": st.builds(lambda ms, m, s, t: {"messages": ms, "max_tokens": m, **s, **t}, messages,
                                          small, stream, tooling),
        "/v1/completions/render": st.builds(lambda p, m: {"prompt": p, "max_tokens": m}, prompt, small),
        "/v1/chat/completions/render": st.builds(lambda ms, m, t: {"messages": ms, "max_tokens": m, **t}, messages,
                                                 small, tooling),
        "/tokenize": st.one_of(st.builds(lambda p: {"prompt": p}, text), st.builds(lambda ms: {"messages": ms},
                                                                                    messages)),
        "/detokenize": st.builds(lambda t: {"tokens": t}, token_ids),
        "/v1/embeddings": st.builds(lambda i: {"input": i}, pooling_input),
        "/pooling": st.builds(lambda i: {"input": i}, pooling_input),
        "/score": st.builds(lambda a, b: {"text_1": a, "text_2": b}, hints["text_1"], hints["text_2"]),
        "/rerank": st.builds(lambda q, d: {"query": q, "documents": d}, text, st.lists(text, min_size=1, max_size=3)),
        "/v1/load_lora_adapter": st.builds(lambda n, p: {"lora_name": n, "lora_path": p}, lora_name, lora_path),
        "/v1/unload_lora_adapter": st.builds(lambda n: {"lora_name": n}, lora_name),
        "/v1/responses": st.builds(lambda i, m, s, t, e: {"input": i, "max_output_tokens": m, **s, **t, **e},
                                   st.one_of(text, responses_items(text)), small, stream, responses_tooling(),
                                   responses_extras()),
        "/v1/score": st.builds(lambda pair, a, b: {pair[0]: a, pair[1]: b},
                               st.sampled_from([("queries", "documents"), ("queries", "items"), ("data_1", "data_2")]),
                               hints["text_1"], hints["text_2"]),
        "/v2/embed": st.builds(lambda t, k: {"texts": t, "embedding_types": k}, st.lists(text, min_size=1, max_size=3),
                               st.lists(st.sampled_from(["float", "base64", "binary", "ubinary"]), min_size=1,
                                        max_size=4)),
    }
    bases["/v2/rerank"] = bases["/rerank"]
    by_route = {path: schemas.body(ROUTES[path], base) for path, base in bases.items()}
    # /invocations: the bodies of the routes it chooses among; /ping: any of them, read by nobody.
    by_route["/invocations"] = st.one_of([by_route[path] for path in (
        "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/score", "/v1/score", "/rerank")])
    by_route["/ping"] = by_route["/invocations"]
    return st.one_of([body.map(lambda body, path=path: Case(path, body))
                      for path, body in by_route.items() if only in (None, path)])


def responses_items(text: st.SearchStrategy) -> st.SearchStrategy:
    """Input items of every kind the Responses API reads, and (one draw in eight) one it refuses."""
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer"]),
                                     "content": st.one_of(text, st.lists(st.fixed_dictionaries(
                                         {"type": st.sampled_from(["input_text", "output_text"]), "text": text}),
                                         max_size=2))})
    call = st.fixed_dictionaries({"type": st.just("function_call"), "call_id": text, "name": st.sampled_from("fg"),
                                  "arguments": st.sampled_from(['{"x": 1}', "{}", "not json", ""])})
    output = st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": text, "output": text})
    reasoning = st.fixed_dictionaries({"type": st.just("reasoning"), "summary": st.just([]), "content": st.lists(
        st.fixed_dictionaries({"type": st.just("reasoning_text"), "text": text}), max_size=2)})
    refused = st.sampled_from([{"type": "item_reference", "id": "x"}, {"type": "web_search_call"}, {"type": "message"},
                               {"role": "tool", "content": "x"},
                               {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])
    valid = st.lists(st.one_of(message, message, call, output, reasoning), min_size=1, max_size=4)
    return st.one_of(*[valid] * 7, valid.flatmap(lambda items: refused.map(lambda item: [*items, item])))


def responses_tooling() -> st.SearchStrategy:
    return st.sampled_from([{}, {}, {}, {"tools": RESPONSES_TOOLS, "tool_choice": "auto"},
                            {"tools": RESPONSES_TOOLS, "tool_choice": "required"},
                            {"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "f"}},
                            {"text": {"format": {"type": "json_object"}}},
                            {"text": {"format": {"type": "json_schema", "name": "s", "schema": TOOLS[0]["function"][
                                "parameters"]}}}])


def responses_extras() -> st.SearchStrategy:
    return st.sampled_from([{}, {}, {}, {"store": False}, {"background": True}, {"instructions": "Be brief."},
                            {"previous_response_id": "resp_unknown"}, {"metadata": {"k": "v"}},
                            {"include": ["message.output_text.logprobs"], "top_logprobs": 2},
                            {"reasoning": {"effort": "low"}, "truncation": "auto", "user": "u"}])


# -- properties ---------------------------------------------------------------------------------------


@dataclass
class Checker:
    document: dict[str, Any]
    statuses: collections.Counter = field(default_factory=collections.Counter)

    def schema(self, ref_or_schema: dict[str, Any]) -> dict[str, Any]:
        # A schema with the document's components beside it, so that its $refs resolve.
        return {**ref_or_schema, "components": self.document["components"]}

    def matches(self, schema: dict[str, Any], value: Any) -> str | None:
        try:
            jsonschema.Draft202012Validator(self.schema(schema)).validate(value)
        except jsonschema.ValidationError as error:
            return f"{error.message} at {list(error.absolute_path)}"
        return None

    def problems(self, case: Case, status: int, content_type: str, body: bytes) -> list[str]:
        """What is wrong with the server's answer to `case` (empty: nothing)."""
        self.statuses[(case.path, status)] += 1
        if status >= 400:
            return self.error_problems(status, body)
        if status != 200:
            return [f"status {status}"]
        if case.path in TEXT_ROUTES:
            return [] if content_type.startswith("text/plain") else [f"200 in {content_type}, not text: {body[:200]!r}"]
        operation = self.document["paths"][case.path]["post"]
        ok = operation["responses"]["200"]["content"]
        if content_type.startswith("text/event-stream"):
            # each event's `data` is [DONE] or JSON: the chunk (or ErrorResponse) schema of the itemSchema;
            # the Responses API's typed events: `data` is always JSON, the event union's schema
            data = ok["text/event-stream"]["itemSchema"]["properties"]["data"]
            if case.path == "/v1/responses":
                return self.stream_problems(data["contentSchema"], body, responses=True)
            return self.stream_problems(next(e["contentSchema"] for e in data["anyOf"] if "contentSchema" in e), body)
        try:
            value = json.loads(body)
        except ValueError:
            return [f"200 with a body that is not JSON: {body[:200]!r}"]
        mismatch = self.matches(ok["application/json"]["schema"], value)
        return [f"200 body does not match its schema: {mismatch}"] if mismatch else []

    def error_problems(self, status: int, body: bytes) -> list[str]:
        try:
            value = json.loads(body)
        except ValueError:
            return [f"{status} with a body that is not JSON: {body[:200]!r}"]
        problems = []
        mismatch = self.matches({"$ref": "#/components/schemas/ErrorResponse"}, value)
        if mismatch or set(value.get("error", {})) != {"message", "type", "param", "code"}:
            problems.append(f"{status} not in OpenAI's error shape ({mismatch}): {body[:300]!r}")
        error = value.get("error") if isinstance(value.get("error"), dict) else {}
        if status >= 500 and not (status == 503 and error.get("code") == "engine_overloaded"):
            problems.append(f"{status} {body[:300]!r}")
        if PYTHON_INTERNALS.search(str(error.get("message"))):
            problems.append(f"{status} whose message names Python internals: {body[:300]!r}")
        return problems

    def stream_problems(self, data_schema: dict[str, Any], body: bytes, *, responses: bool = False) -> list[str]:
        """A stream's problems: chat's and completions' (`data:` events, then [DONE]), or the Responses
        API's (typed events, each `data:` naming its `type`, ending with response.completed, .incomplete or
        .failed; an `error` event is the error shape's `error`)."""
        events = [line[len(b"data: "):] for line in body.split(b"\n") if line.startswith(b"data: ")]
        if not events:
            return [f"a stream without events: {body[:200]!r}"]
        problems = []
        for event in events:
            if event == b"[DONE]":
                continue
            value = json.loads(event)
            if responses and value.get("type") == "error":
                value = {"error": value}
            if "error" in value:
                error = value["error"]
                if error.get("type") == "internal_error" or error.get("code") == "engine_dead":
                    problems.append(f"an error event mid-stream: {event[:300]!r}")
                elif PYTHON_INTERNALS.search(str(error.get("message"))):
                    problems.append(f"an error event whose message names Python internals: {event[:300]!r}")
                continue
            mismatch = self.matches(data_schema, value)
            if mismatch:
                problems.append(f"a stream event does not match its schema: {mismatch}")
        if responses:
            if json.loads(events[-1]).get("type") not in RESPONSES_ENDS:
                problems.append(f"a Responses stream that does not end with {RESPONSES_ENDS}: {events[-1][:200]!r}")
        elif events[-1] != b"[DONE]" and b'"error"' not in events[-1]:
            problems.append(f"a stream that does not end with [DONE]: {events[-1][:200]!r}")
        return problems


def answers_normally(server) -> str | None:
    path, body = NORMAL_REQUEST
    status, _, answer = send(server, "POST", path, json.dumps(body).encode())
    return None if status == 200 else f"then a normal request got {status}: {answer[:300]!r}"


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


# -- the tests ----------------------------------------------------------------------------------------


def test_the_server_serves_its_contract_built_once(fuzz_server, document, tiny_model):
    from asyncengine.server import routes
    from asyncengine.server.access import PUBLIC_PATHS
    from asyncengine.server.openapi import openapi_document
    from asyncengine.sampling_bounds import RequestBounds
    from asyncengine.server.serving_lora import LORA_ROUTES

    status, content_type, again = send(fuzz_server, "GET", "/openapi.json")
    assert status == 200 and content_type == "application/json"
    assert json.loads(again) == document  # built at app creation: the same document every time
    vocab = tiny_model("llama").hf_model.config.vocab_size
    bounds = RequestBounds(max_n=128, max_logprobs=20, max_model_len=MAX_MODEL_LEN, max_token_id=vocab - 1)
    expected = openapi_document(routes._BUILTIN + LORA_ROUTES, title="asyncengine", version=document["info"]["version"],
                                api_key=True, open_routes=PUBLIC_PATHS, bounds=bounds)
    assert document == json.loads(json.dumps(expected))  # this server's bounds, its LoRA routes
    assert document["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in document["paths"]["/health"]["get"]


def test_fuzzed_requests_never_hurt_the_server(fuzz_server, document, lora_paths):
    checker = Checker(document)
    routes_seen: collections.Counter = collections.Counter()

    # Each example is two cases sent at once, so that a bad request also meets another one in the engine
    # (no request may hurt another); then a normal request. The first case of a pair is drawn for one route
    # at a time: hypothesis' one_of favours its first branches, which left a route with few cases.
    def two_cases_for(path: str):
        @settings(max_examples=FEWER_EXAMPLES.get(path, EXAMPLES_PER_ROUTE), derandomize=True, database=None, deadline=None,
                  print_blob=False, phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(pair=st.tuples(cases(document, lora_paths, only=path), cases(document, lora_paths)))
        def two_cases(pair: tuple[Case, Case]) -> None:
            with concurrent.futures.ThreadPoolExecutor(len(pair)) as pool:
                answers = list(pool.map(lambda case: send(fuzz_server, "POST", case.path, encode_body(case.body)),
                                        pair))
            problems = []
            for case, (status, content_type, body) in zip(pair, answers):
                routes_seen[case.path] += 1
                problems += [f"{case!r} -> {status}: {p}" for p in checker.problems(case, status, content_type, body)]
            problems += [p for p in [answers_normally(fuzz_server)] if p]
            assert not problems, "\n".join(problems)

        return two_cases

    started = time.monotonic()
    for path in ROUTES:
        two_cases_for(path)()
    elapsed = time.monotonic() - started
    print(f"\n{sum(routes_seen.values())} fuzzed cases in {elapsed:.1f} s; by route {dict(routes_seen)}; "
          f"statuses {dict(checker.statuses)}")
    assert sum(routes_seen.values()) == 2 * sum(FEWER_EXAMPLES.get(path, EXAMPLES_PER_ROUTE) for path in ROUTES)
    assert all(routes_seen[path] >= FEWER_EXAMPLES.get(path, EXAMPLES_PER_ROUTE) for path in ROUTES), routes_seen
    # Valid bodies got through, not only refusals: adapters loaded, embeddings made, tool calls forced.
    for path in ("/v1/load_lora_adapter", "/v1/embeddings", "/pooling", "/score", "/v1/chat/completions",
                 "/v1/completions/render", "/v1/chat/completions/render", "/v1/responses",
                 "/v2/embed", "/invocations", "/ping"):
        assert checker.statuses[(path, 200)] > 0, (path, dict(checker.statuses))
    assert wait_for(lambda: metric(fuzz_server, "num_requests_running") == 0, 30), "requests still running"
    assert wait_for(lambda: metric(fuzz_server, "kv_cache_usage_perc") == 0, 30), "KV blocks still held"


def test_fuzzed_response_ids_get_404_or_the_stored_response(fuzz_server, document):
    # GET /v1/responses/{id} and POST /v1/responses/{id}/cancel with ids of any text (escaped into the path:
    # slashes, NULs, unicode, 10k characters) and with the ids of responses this server made: a 404 naming
    # response_id, a 400 (cancelling what is not a running background response), or the stored response
    # in its schema; never a 5xx. (An empty id or one with a slash is another path: the router's 404 or 405.)
    checker = Checker(document)
    made = [json.loads(send(fuzz_server, "POST", "/v1/responses", json.dumps(body).encode())[2])["id"]
            for body in ({"input": "a", "max_output_tokens": 2}, {"input": "b", "max_output_tokens": 2,
                                                                  "background": True})]
    ids = st.one_of(st.sampled_from(made), st.text(max_size=40),
                    st.sampled_from("a/%\x00").map(lambda char: char * 10_000))
    statuses: collections.Counter = collections.Counter()

    @settings(max_examples=30, derandomize=True, database=None, deadline=None, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(response_id=ids, cancel=st.booleans())
    def one(response_id: str, cancel: bool) -> None:
        path = f"/v1/responses/{urllib.parse.quote(response_id, safe='')}" + ("/cancel" if cancel else "")
        status, _, body = send(fuzz_server, "POST" if cancel else "GET", path, b"" if cancel else None)
        statuses[status] += 1
        if status == 200:
            mismatch = checker.matches({"$ref": "#/components/schemas/ResponsesResponse"}, json.loads(body))
            assert mismatch is None and json.loads(body)["id"] == response_id, mismatch
        else:
            assert status in (400, 404, 405, 414), (path[:200], status, body[:300])
            if status != 414:  # (a URL past the HTTP server's line limit: its own plain answer)
                assert not checker.error_problems(status, body), body[:300]
            if response_id and "/" not in response_id and status != 414:  # the id reached the view (an empty
                # one, or one with a slash, is another path: the router's 404 or 405)
                assert json.loads(body)["error"]["param"] == "response_id", body[:300]

    one()
    assert statuses[200] > 0 and statuses[404] > 0, statuses
    assert answers_normally(fuzz_server) is None

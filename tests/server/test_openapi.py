"""GET /openapi.json: an OpenAPI 3.2 document of the server's contract, generated from the Structs.

Checked here: the document is valid OpenAPI 3.2 (openapi-spec-validator), every route an app serves is in
it with its method (the app's URL map against the document, LoRA routes included), every $ref resolves, the
bounds the server enforces are the schema's (and agree with SamplingParams'), required fields are marked,
streams are described as the events sent, and the request schemas accept the bodies the official client
sends and reject an unknown field. That every answer of a real server matches the document is
tests/server/test_schemathesis.py's.
"""

from __future__ import annotations

import http.server
import json
import re
import math
import threading
import typing
from typing import Annotated, Any

import anyio
import jsonschema
import msgspec
import openai
import pytest
from openapi_spec_validator import validate

from asyncengine import AsyncEngine, RequestError, SamplingParams
from asyncengine.server import openapi, protocol, routes
from asyncengine.server.access import PUBLIC_PATHS
from asyncengine.server.app import create_app
from asyncengine.server.config import ServerConfig
from asyncengine.server.invocations import invocation_view
from asyncengine.server.openapi import CONTRACTS, openapi_document
from asyncengine.sampling_bounds import RequestBounds
from asyncengine.server.request_bounds import bounded
from asyncengine.server.serving_lora import LORA_ROUTES

BOUNDS = RequestBounds(max_n=7, max_logprobs=5, max_model_len=300, max_token_id=258)


def openapi_path(rule: str) -> str:
    """Werkzeug's `/v1/responses/<response_id>` as OpenAPI's `/v1/responses/{response_id}`."""
    return re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule)


def document(*, api_key: bool = True, bounds: RequestBounds | None = BOUNDS,
             strict_fields: bool = False) -> dict[str, Any]:
    return json.loads(json.dumps(openapi_document(routes._BUILTIN + LORA_ROUTES, title="asyncengine", version="0",
                                                  api_key=api_key, open_routes=PUBLIC_PATHS, bounds=bounds,
                                                  strict_fields=strict_fields)))


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if "$ref" in node else []
        return own + [r for value in node.values() for r in refs(value)]
    if isinstance(node, list):
        return [r for value in node for r in refs(value)]
    return []


def resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def test_the_document_is_valid_openapi_3_2_with_every_builtin_route():
    doc = document()
    validate(doc)  # raises on anything that is not OpenAPI 3.2
    assert doc["openapi"] == "3.2.0"
    for rule, method, name in routes._BUILTIN + LORA_ROUTES:
        operation = doc["paths"][openapi_path(rule)][method.lower()]
        assert "200" in operation["responses"]
        assert {"4XX", "5XX"} <= operation["responses"].keys()
        if CONTRACTS[name].request is not None:
            assert "application/json" in operation["requestBody"]["content"]
    # A path parameter is OpenAPI's {name}, declared (Werkzeug's <name> in the rule).
    retrieve = doc["paths"]["/v1/responses/{response_id}"]["get"]
    assert retrieve["parameters"] == [{"name": "response_id", "in": "path", "required": True,
                                       "schema": {"type": "string"}}]
    assert not any("<" in path for path in doc["paths"])
    for ref in refs(doc):
        resolve(doc, ref)  # every $ref resolves (KeyError otherwise)
    assert len(set(refs(doc))) > 10


def test_errors_streams_and_auth_are_declared():
    doc = document()
    error = doc["components"]["schemas"]["ErrorResponse"]
    assert error["required"] == ["error"] and error["additionalProperties"] is False
    detail = doc["components"]["schemas"]["ErrorDetail"]
    assert set(detail["required"]) == {"message", "type", "param", "code"}
    # A stream is text/event-stream whose itemSchema is one event: `data` is [DONE], or JSON holding a chunk
    # (or an ErrorResponse, for a failure after the stream began).
    for path, chunk in [("/v1/chat/completions", "ChatCompletionChunk"), ("/v1/completions", "CompletionResponse")]:
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert "application/json" in content
        event = content["text/event-stream"]["itemSchema"]
        assert event["required"] == ["data"]
        done, payload = event["properties"]["data"]["anyOf"]
        assert done == {"const": "[DONE]", "description": done["description"]}
        assert payload["contentMediaType"] == "application/json"
        assert payload["contentSchema"] == {"anyOf": [{"$ref": f"#/components/schemas/{chunk}"},
                                                      {"$ref": "#/components/schemas/ErrorResponse"}]}
    assert "text/event-stream" not in doc["paths"]["/tokenize"]["post"]["responses"]["200"]["content"]
    # --api-key covers every route but the probes (/health, SageMaker's /ping), /metrics, /version and the /docs
    # page (static: the contract it shows comes from /openapi.json, which is covered).
    secured = {rule for rule, item in doc["paths"].items() for op in item.values() if op.get("security")}
    assert secured == set(doc["paths"]) - {"/health", "/ping", "/metrics", "/version", "/docs"}
    responses_ok = doc["paths"]["/v1/responses"]["post"]["responses"]["200"]["content"]
    event = responses_ok["text/event-stream"]["itemSchema"]
    assert event["required"] == ["event", "data"]  # typed events: `event: TYPE` then its `data:`, no [DONE]
    event_refs = refs(event["properties"]["data"]["contentSchema"])  # one schema per event type
    assert {"#/components/schemas/ResponseCompletedEvent", "#/components/schemas/OutputTextDeltaEvent"} <= set(
        event_refs) and len(event_refs) >= 16
    assert "401" in doc["paths"]["/tokenize"]["post"]["responses"]
    assert "bearer" in doc["components"]["securitySchemes"]
    without_key = document(api_key=False)
    assert not any(op.get("security") for item in without_key["paths"].values() for op in item.values())
    assert "securitySchemes" not in without_key["components"]
    # The LoRA routes answer vLLM's plain text.
    assert doc["paths"]["/v1/load_lora_adapter"]["post"]["responses"]["200"]["content"] == {
        "text/plain": {"schema": {"type": "string"}}}


def test_required_fields_are_marked():
    schemas = document()["components"]["schemas"]
    assert "prompt" in schemas["CompletionRequest"]["required"]  # (it was optional, and a 400 when missing)
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
    assert set(schemas["LoadLoRAAdapterRequest"]["required"]) == {"lora_name", "lora_path"}
    # The server writes every field of what it sends: all required, defaults included ...
    for name in ("ChatCompletionResponse", "ChatCompletionChunk", "CompletionResponse", "CompletionChoice",
                 "Usage", "ModelCard", "EmbeddingResponse", "RerankResult"):
        assert set(schemas[name]["required"]) == set(schemas[name]["properties"]), name
    # ... but a Struct that omits defaults (a chunk's delta) and one requests send too (StreamOptions) do not.
    assert not schemas["DeltaMessage"].get("required")
    assert not schemas["StreamOptions"].get("required")


def test_the_bounds_the_server_enforces_are_in_the_schema():
    schemas = document()["components"]["schemas"]

    def prop(struct: str, name: str) -> dict[str, Any]:
        value = schemas[struct]["properties"][name]
        return next((s for s in value.get("anyOf", [value]) if s.get("type") != "null"), value)

    # From the configuration (BOUNDS): --max-n, --max-logprobs, the context, the vocabulary.
    assert (prop("CompletionRequest", "n")["minimum"], prop("CompletionRequest", "n")["maximum"]) == (1, 7)
    assert "--max-n" in prop("CompletionRequest", "n")["description"]
    assert prop("CompletionRequest", "logprobs")["maximum"] == 5
    assert prop("ChatCompletionRequest", "top_logprobs")["maximum"] == 5
    for struct, name in [("CompletionRequest", "max_tokens"), ("ChatCompletionRequest", "max_completion_tokens"),
                         ("ChatCompletionRequest", "min_tokens"), ("IOProcessRequest", "max_tokens")]:
        assert prop(struct, name)["maximum"] == 300, (struct, name)
    assert prop("CompletionRequest", "stop_token_ids")["items"] == {
        "type": "integer", "minimum": 0, "maximum": 258, "description": prop(
            "CompletionRequest", "stop_token_ids")["items"]["description"]}
    assert prop("DetokenizeRequest", "tokens")["items"]["maximum"] == 258
    assert '"maximum": 258' in json.dumps(schemas["CompletionRequest"]["properties"]["prompt"])
    assert '"maximum": 258' in json.dumps(schemas["EmbeddingRequest"]["properties"]["input"])
    # SamplingParams' ranges.
    assert prop("CompletionRequest", "top_p") == {"type": "number", "exclusiveMinimum": 0.0, "maximum": 1.0}
    assert (prop("ChatCompletionRequest", "min_p")["minimum"], prop("ChatCompletionRequest", "min_p")["maximum"]) \
        == (0.0, 1.0)
    assert prop("CompletionRequest", "presence_penalty")["maximum"] == 2.0
    assert prop("CompletionRequest", "repetition_penalty")["minimum"] > 0
    assert prop("CompletionRequest", "logit_bias")["additionalProperties"] == {"type": "number", "minimum": -100.0,
                                                                             "maximum": 100.0}
    # /rerank's top_n: at least 1, an int64 (10^40 was accepted).
    assert (prop("RerankRequest", "top_n")["minimum"], prop("RerankRequest", "top_n")["maximum"]) == (1, 2**63 - 1)


# SamplingFields' fields that are SamplingParams arguments of the same name (and meaning).
SAMPLING_ARGUMENTS = ["n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                      "repetition_penalty", "min_tokens", "max_tokens", "logprobs"]


def _range(tp: Any) -> msgspec.Meta | None:
    for arg in typing.get_args(tp):
        if typing.get_origin(arg) is Annotated:
            return next(m for m in typing.get_args(arg)[1:] if isinstance(m, msgspec.Meta))
    if typing.get_origin(tp) is Annotated:
        return next(m for m in typing.get_args(tp)[1:] if isinstance(m, msgspec.Meta))
    return None


def _probes(meta: msgspec.Meta, is_int: bool) -> list[tuple[Any, bool]]:
    """(value, inside the range) at each end of `meta`'s range: the bound, and the nearest value past it."""
    step = (lambda v, d: v + d) if is_int else (lambda v, d: math.nextafter(v, math.inf * d))
    probes = []
    for bound, inclusive, direction in [(meta.ge, True, -1), (meta.gt, False, -1), (meta.le, True, 1),
                                        (meta.lt, False, 1)]:
        if bound is not None:
            probes += [(bound, inclusive), (step(bound, direction), False) if inclusive else
                       (step(bound, -direction), True)]
    return probes


def test_the_schema_bounds_are_the_engines():
    # The Structs' ranges (without this server's limits: SamplingParams' own) accept and refuse what
    # SamplingParams does, at each end: a bound changed on one side only fails here.
    fields = {info.name: info.type for info in msgspec.structs.fields(protocol.CompletionRequest)}
    checked = 0
    for name in SAMPLING_ARGUMENTS:
        meta = _range(fields[name])
        assert meta is not None, f"{name} has no bounds in protocol.py"
        is_int = '"integer"' in json.dumps(msgspec.json.schema(fields[name]))
        for value, inside in _probes(meta, is_int):
            body = {"prompt": "x", name: value}
            try:
                msgspec.json.decode(json.dumps(body), type=protocol.CompletionRequest)
                schema_ok = True
            except msgspec.ValidationError:
                schema_ok = False
            extra = {"max_tokens": None} if name == "min_tokens" else {}
            try:
                SamplingParams(**{name: value, **extra})
                engine_ok = True
            except RequestError:
                engine_ok = False
            assert (schema_ok, engine_ok) == (inside, inside), (name, value)
            checked += 1
    assert checked >= 40


def test_a_value_past_a_configured_bound_is_a_400_naming_the_flag():
    from asyncengine.server.errors import from_validation_error

    struct = bounded(protocol.CompletionRequest, BOUNDS)
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.json.decode(b'{"prompt": "x", "n": 8}', type=struct)
    error = from_validation_error(info.value, struct)
    assert (error.status, error.param) == (400, "n")
    assert error.message == "n must be at most 7 (max_n=7: the server's --max-n)"
    assert bounded(protocol.CompletionRequest, BOUNDS) is struct  # built once per configuration
    assert bounded(protocol.Tool, BOUNDS) is protocol.Tool  # nothing to bound: the Struct itself


def test_endpoint_plugin_routes_are_listed_behind_the_key():
    doc = openapi_document(routes._BUILTIN, title="asyncengine", version="0", api_key=True,
                           open_routes=PUBLIC_PATHS, plugin_routes=[("/plugin/hello", "GET"), ("/plugin/echo", "POST"),
                                                                    ("/plugin/items/<int:item_id>", "GET")])
    validate(json.loads(json.dumps(doc)))
    assert doc["paths"]["/plugin/echo"]["post"]["security"] == [{"bearer": []}]
    assert "default" in doc["paths"]["/plugin/hello"]["get"]["responses"]
    item = doc["paths"]["/plugin/items/{item_id}"]["get"]  # werkzeug's converter as OpenAPI's template
    assert item["parameters"] == [{"name": "item_id", "in": "path", "required": True, "schema": {"type": "string"}}]


def test_every_route_an_app_serves_is_in_its_document(tiny_model):
    # The app's URL map against the document it serves: a route added anywhere without its Contract fails
    # create_app, and none is left out (the runtime LoRA routes were).
    async def app_routes_and_document() -> tuple[set[tuple[str, str]], dict[str, Any]]:
        async with AsyncEngine.start(model=str(tiny_model("llama").path), max_model_len=128, enable_lora=True,
                                     max_lora_rank=4, skip_tokenizer_init=True) as engine:
            app = create_app(engine, ServerConfig(api_key="k", enable_runtime_lora_updates=True))
            served = {(openapi_path(rule), method) for rule, method, _ in routes.served_routes(app)}
            return served, json.loads(await app.extensions["asyncengine"]["openapi"].encoded())

    served, doc = anyio.run(app_routes_and_document, backend="trio")
    listed = {(path, method.upper()) for path, item in doc["paths"].items() for method in item}
    assert listed == served
    assert {("/v1/load_lora_adapter", "POST"), ("/v1/unload_lora_adapter", "POST")} <= listed
    validate(doc)
    n = doc["components"]["schemas"]["CompletionRequest"]["properties"]["n"]
    assert n["maximum"] == 128  # the engine's --max-n (its default), not the fallback


def test_a_builtin_route_without_a_contract_is_an_error_naming_it():
    with pytest.raises(RuntimeError, match="'mystery'.*openapi.py"):
        openapi_document([("/mystery", "GET", "mystery")], title="t", version="0", api_key=False)
    assert {name for _, _, name in routes._BUILTIN} <= CONTRACTS.keys()


def test_a_bound_declared_on_a_struct_field_is_in_the_schema():
    # The document is msgspec's schema of the Structs: a Meta bound becomes minimum and maximum, so the
    # bounds protocol.py declares reach clients (and the fuzzer, which draws each bound and one past it).
    class Bounded(msgspec.Struct, forbid_unknown_fields=True):
        n: Annotated[int, msgspec.Meta(ge=1, le=128)] = 1

    _, components = msgspec.json.schema_components([Bounded], ref_template=openapi._REF)
    assert components["Bounded"]["properties"]["n"] == {"type": "integer", "minimum": 1, "maximum": 128,
                                                        "default": 1}


# -- the bodies the official client sends ---------------------------------------------------------------


class _Recorder(http.server.BaseHTTPRequestHandler):
    bodies: list[tuple[str, dict]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Recorder.bodies.append((self.path, body))
        self.send_response(500)  # the client raises; the body is what we wanted
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": {"message": "recorded", "type": "x", "param": null, "code": null}}')

    def log_message(self, *args: Any) -> None:
        pass


def client_bodies() -> list[tuple[str, dict]]:
    """What openai.OpenAI sends for the calls a user makes (every parameter we implement)."""
    _Recorder.bodies = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="k", max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": [{"type": "text", "text": "x"}]}]
    tools = [{"type": "function", "function": {"name": "f", "description": "d",
                                               "parameters": {"type": "object", "properties": {}}}}]
    calls = [
        lambda: client.completions.create(model="m", prompt="Hello", max_tokens=4),
        lambda: client.completions.create(model="m", prompt=["a", "b"], max_tokens=4, temperature=0.5, top_p=0.9,
                                          n=2, stop=["x"], seed=3, presence_penalty=0.1, frequency_penalty=0.2,
                                          logprobs=2, user="u", stream=True, stream_options={"include_usage": True},
                                          extra_body={"top_k": 5, "min_tokens": 1, "ignore_eos": True}),
        lambda: client.completions.create(model="m", prompt=[[1, 2], [3]], max_tokens=1),
        lambda: client.chat.completions.create(model="m", messages=messages),
        lambda: client.chat.completions.create(model="m", messages=messages, max_completion_tokens=4,
                                               logprobs=True, top_logprobs=2, tools=tools, tool_choice="auto",
                                               stream=True, stream_options={"include_usage": True},
                                               response_format={"type": "text"}, seed=1, stop="x",
                                               extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                                           "repetition_penalty": 1.1}),
        lambda: client.responses.create(model="m", input="Hi"),
        lambda: client.responses.create(
            model="m", instructions="Be brief.", max_output_tokens=4, temperature=0.5, top_p=0.9, store=True,
            metadata={"k": "v"}, previous_response_id="resp_1", parallel_tool_calls=False, tool_choice="required",
            tools=[{"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"},
                    "strict": True}],
            text={"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}},
            reasoning={"effort": "low"}, include=["message.output_text.logprobs"], top_logprobs=2, user="u",
            truncation="disabled", stream=True,
            input=[{"role": "user", "content": [{"type": "input_text", "text": "x"}]},
                   {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                   {"type": "function_call_output", "call_id": "c", "output": "done"}]),
    ]
    try:
        for call in calls:
            with pytest.raises(openai.APIStatusError):
                result = call()
                for _ in result:  # a stream raises as it is read
                    pass
    finally:
        server.shutdown()
        client.close()
    return list(_Recorder.bodies)


REQUEST_SCHEMAS = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest",
                   "/v1/responses": "ResponsesRequest"}


def validator(doc: dict[str, Any], name: str) -> jsonschema.Validator:
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": doc["components"]})


def test_request_schemas_accept_the_openai_clients_bodies_and_reject_unknown_fields():
    # With --strict-request-fields the document says what the server does: an unknown field is refused.
    doc = document(strict_fields=True)
    lenient = document()
    bodies = client_bodies()
    assert len(bodies) == 7
    for path, body in bodies:
        request_schema = validator(doc, REQUEST_SCHEMAS[path])
        request_schema.validate(body)  # raises jsonschema.ValidationError naming the field
        with pytest.raises(jsonschema.ValidationError, match="frobnicate"):
            request_schema.validate({**body, "frobnicate": True})
        # By default the server ignores it (X-Ignored-Fields), and so does the document; nested objects stay strict.
        validator(lenient, REQUEST_SCHEMAS[path]).validate({**body, "frobnicate": True})
        with pytest.raises(jsonschema.ValidationError, match="frobnicate"):
            validator(lenient, REQUEST_SCHEMAS[path]).validate({**body, "stream_options": {"frobnicate": True}})
    for name, body in [("TokenizeRequest", {"prompt": "Hi"}), ("TokenizeRequest", {"messages": [{"role": "user",
                                                                                                   "content": "x"}]}),
                       ("DetokenizeRequest", {"tokens": [1, 2]})]:
        validator(doc, name).validate(body)
        with pytest.raises(jsonschema.ValidationError):
            validator(doc, name).validate({**body, "frobnicate": True})
    with pytest.raises(jsonschema.ValidationError):
        validator(doc, "DetokenizeRequest").validate({})  # a required field missing


def test_the_request_examples_are_valid_bodies():
    # The document's examples (what schemathesis sends first) are bodies its own schemas accept, and msgspec
    # decodes into the request Struct with this server's bounds.
    doc = document()
    seen = 0
    for name, contract in CONTRACTS.items():
        for value in contract.examples:
            struct = contract.request
            if isinstance(struct, tuple):  # /invocations: the request of the route the body's fields choose
                struct = CONTRACTS[invocation_view(json.dumps(value).encode(), "embed")].request
                assert struct in contract.request
            validator(doc, struct.__name__).validate(value)
            msgspec.json.decode(json.dumps(value), type=bounded(struct, BOUNDS))
            seen += 1
    assert seen >= 15
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert any(example["value"].get("stream") for example in chat["examples"].values())

"""GET /openapi.json: an OpenAPI 3.1 document of the server's contract, generated from the Structs.

Checked here: the document is valid OpenAPI 3.1 (openapi-spec-validator), every built-in route is in
it with its method, every $ref resolves, and the request schemas accept the bodies the official
client sends and reject an unknown field. The route itself, on a running server, and that every
answer of that server matches the document, are checked in test_fuzz.py (on the server it fuzzes).
"""

from __future__ import annotations

import http.server
import json
import threading
from typing import Annotated, Any

import jsonschema
import msgspec
import openai
import pytest
from openapi_spec_validator import validate

from asyncengine.server import openapi, routes
from asyncengine.server.access import PUBLIC_PATHS
from asyncengine.server.openapi import CONTRACTS, openapi_document, openapi_path


def document(*, api_key: bool = True) -> dict[str, Any]:
    return json.loads(json.dumps(openapi_document(routes._BUILTIN, title="asyncengine", version="0", api_key=api_key,
                                                  open_routes=PUBLIC_PATHS)))


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


def test_the_document_is_valid_openapi_3_1_with_every_builtin_route():
    doc = document()
    validate(doc)  # raises on anything that is not OpenAPI 3.1
    assert doc["openapi"] == "3.1.0"
    for rule, method, name in routes._BUILTIN:
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
    chat_ok = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert chat_ok["text/event-stream"]["x-event-data"] == {"$ref": "#/components/schemas/ChatCompletionChunk"}
    completions_ok = doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert "text/event-stream" in completions_ok
    assert "text/event-stream" not in doc["paths"]["/tokenize"]["post"]["responses"]["200"]["content"]
    # --api-key covers every route but /health, /metrics and /version; /openapi.json included.
    secured = {rule for rule, item in doc["paths"].items() for op in item.values() if op.get("security")}
    assert secured == {openapi_path(rule) for rule, _ in routes.builtin_route_keys()} - {"/health", "/metrics",
                                                                                         "/version"}
    responses_ok = doc["paths"]["/v1/responses"]["post"]["responses"]["200"]["content"]
    assert responses_ok["text/event-stream"]["schema"]["description"].startswith("`event: TYPE`")
    event_refs = refs(responses_ok["text/event-stream"]["x-event-data"])  # one schema per event type
    assert {"#/components/schemas/ResponseCompletedEvent", "#/components/schemas/OutputTextDeltaEvent"} <= set(
        event_refs) and len(event_refs) >= 16
    assert "401" in doc["paths"]["/tokenize"]["post"]["responses"]
    assert "bearer" in doc["components"]["securitySchemes"]
    without_key = document(api_key=False)
    assert not any(op.get("security") for item in without_key["paths"].values() for op in item.values())
    assert "securitySchemes" not in without_key["components"]


def test_endpoint_plugin_routes_are_listed_behind_the_key():
    doc = openapi_document(routes._BUILTIN, title="asyncengine", version="0", api_key=True,
                           open_routes=PUBLIC_PATHS, plugin_routes=[("/plugin/hello", "GET"), ("/plugin/echo", "POST")])
    validate(json.loads(json.dumps(doc)))
    assert doc["paths"]["/plugin/echo"]["post"]["security"] == [{"bearer": []}]
    assert "default" in doc["paths"]["/plugin/hello"]["get"]["responses"]


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
    doc = document()
    bodies = client_bodies()
    assert len(bodies) == 7
    for path, body in bodies:
        request_schema = validator(doc, REQUEST_SCHEMAS[path])
        request_schema.validate(body)  # raises jsonschema.ValidationError naming the field
        with pytest.raises(jsonschema.ValidationError, match="frobnicate"):
            request_schema.validate({**body, "frobnicate": True})
    for name, body in [("TokenizeRequest", {"prompt": "Hi"}), ("TokenizeRequest", {"messages": [{"role": "user",
                                                                                                   "content": "x"}]}),
                       ("DetokenizeRequest", {"tokens": [1, 2]})]:
        validator(doc, name).validate(body)
        with pytest.raises(jsonschema.ValidationError):
            validator(doc, name).validate({**body, "frobnicate": True})
    with pytest.raises(jsonschema.ValidationError):
        validator(doc, "DetokenizeRequest").validate({})  # a required field missing

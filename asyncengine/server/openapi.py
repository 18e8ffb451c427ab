"""The server's contract as an OpenAPI 3.1 document (`GET /openapi.json`), generated from the Structs.

Each built-in route has a `Contract` here: its request Struct (a JSON body), its response Struct, and
for the routes that stream, the Struct each server-sent event carries. `openapi_document` turns them
into one document with `msgspec.json.schema_components`, so the schemas are the very types the routes
decode and encode: a field added to a Struct is in the document, and a bound declared on it
(`msgspec.Meta(ge=..., le=...)`) becomes the schema's minimum and maximum. The document is built once,
when the app is created; a built-in route without a contract is an error then, not a gap in the
document. Routes an endpoint plugin adds are listed by path and method, without schemas (the plugin
owns them).

A few routes answer plain dicts rather than Structs (`/tokenize`, `/detokenize`, `/version`) and every
error is `{"error": {...}}` (server/errors.py): their shapes are declared below, and the fuzz test
(tests/server/test_fuzz.py) checks every answer the server gives against this document.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncengine.plugin_runtime.records import StartupRecord
from asyncengine.server import protocol, protocol_pooling, protocol_responses

OPENAPI_VERSION = "3.1.0"
_REF = "#/components/schemas/{name}"


# -- the shapes of the routes that answer plain dicts, and of every error ---------------------------------


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str  # what was wrong and what to do
    type: str  # "invalid_request_error", "authentication_error", "service_unavailable", "internal_error", ...
    param: str | None  # the request field at fault, with its path ("messages[0].role"), when there is one
    code: str | None  # "invalid_value", "missing_parameter", "context_length_exceeded", "engine_overloaded", ...


class ErrorResponse(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's error shape: every 4xx and 5xx the server answers has this body."""

    error: ErrorDetail


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class VersionResponse(msgspec.Struct, kw_only=True):
    version: str


# -- one contract per built-in route ------------------------------------------------------------------


@dataclass(frozen=True)
class Contract:
    summary: str
    request: type | None = None  # the JSON body's Struct (POST routes)
    response: Any = None  # the 200 JSON body's type; None with `response_media` for a non-JSON body
    stream_event: Any = None  # with `stream: true` the 200 is server-sent events, each `data:` this (a type)
    response_media: str | None = None  # a 200 that is not JSON: its content type
    stream_note: str = ("`data: <JSON>` events (an error mid-stream is an ErrorResponse event), ending with "
                        "`data: [DONE]`")


# Keyed by the view name of routes._BUILTIN.
CONTRACTS: dict[str, Contract] = {
    "models": Contract("The served model", response=protocol.ModelList),
    "completions": Contract("Text completions (OpenAI's /v1/completions)", request=protocol.CompletionRequest,
                            response=protocol.CompletionResponse, stream_event=protocol.CompletionResponse),
    "chat_completions": Contract("Chat completions (OpenAI's /v1/chat/completions)",
                                 request=protocol.ChatCompletionRequest, response=protocol.ChatCompletionResponse,
                                 stream_event=protocol.ChatCompletionChunk),
    "completions_render": Contract("A completion request rendered and tokenized, not run (vLLM's; one per prompt)",
                                   request=protocol.CompletionRequest, response=list[protocol.RenderedRequest]),
    "chat_completions_render": Contract("A chat request through the chat template and tokenized, not run (vLLM's)",
                                        request=protocol.ChatCompletionRequest, response=protocol.RenderedRequest),
    "io_process": Contract("The IO processor chosen by --io-processor-plugin", request=protocol.IOProcessRequest,
                           response=protocol.IOProcessResponse),
    "startup": Contract("The start-up report of every process", response=list[StartupRecord]),
    "tokenize": Contract("Tokenize a prompt, or chat messages through the chat template",
                         request=protocol.TokenizeRequest, response=TokenizeResponse),
    "detokenize": Contract("Token ids to text", request=protocol.DetokenizeRequest, response=DetokenizeResponse),
    "health": Contract("200 (an empty body) while the engine serves; 503 when it is dead or shutting down"),
    "metrics": Contract("Prometheus metrics", response_media="text/plain; version=0.0.4"),
    "version": Contract("The asyncengine version", response=VersionResponse),
    "openapi": Contract("This document: the server's contract, OpenAPI 3.1", response=dict[str, Any]),
    # Pooling models (docs/pooling.md; server/serving_pooling.py).
    "embeddings": Contract("Embeddings (OpenAI's /v1/embeddings)", request=protocol_pooling.EmbeddingRequest,
                           response=protocol_pooling.EmbeddingResponse),
    "pooling": Contract("The pooler's output, or an IO processor's response over pooled outputs",
                        request=protocol_pooling.PoolingRequest,
                        response=protocol_pooling.PoolingResponse | protocol_pooling.PoolingIOResponse),
    "classify": Contract("Class probabilities of a classification model", request=protocol_pooling.ClassificationRequest,
                         response=protocol_pooling.ClassificationResponse),
    "score": Contract("Scores of text pairs (a cross-encoder, or the cosine of two embeddings)",
                      request=protocol_pooling.ScoreRequest, response=protocol_pooling.ScoreResponse),
    "rerank": Contract("Documents ranked against a query (Jina's and Cohere's shape)",
                       request=protocol_pooling.RerankRequest, response=protocol_pooling.RerankResponse),
    "v1_rerank": Contract("Documents ranked against a query (as /rerank)", request=protocol_pooling.RerankRequest,
                          response=protocol_pooling.RerankResponse),
    # OpenAI's Responses API (docs/server.md; server/serving_responses.py).
    "responses_create": Contract("A response (OpenAI's Responses API); streamed as typed events, each `event: TYPE`",
                                 request=protocol_responses.ResponsesRequest,
                                 response=protocol_responses.ResponsesResponse,
                                 stream_event=protocol_responses.ResponseStreamEvent,
                                 stream_note="`event: TYPE` and `data: <JSON>` pairs, numbered by sequence_number, "
                                             "from response.created to response.completed, response.incomplete or "
                                             "(after an `error` event) response.failed; no [DONE]"),
    "responses_retrieve": Contract("A stored response (store: true), by id", response=protocol_responses.ResponsesResponse),
    "responses_cancel": Contract("Cancel a background response (an empty JSON body)",
                                 response=protocol_responses.ResponsesResponse),
}

# A path parameter as Werkzeug writes it in a rule (`<response_id>`), and as OpenAPI does (`{response_id}`).
_RULE_PARAMETER = re.compile(r"<(?:[a-z_]+:)?([A-Za-z_][A-Za-z0-9_]*)>")


def openapi_path(rule: str) -> str:
    """The OpenAPI path of a route's rule: /v1/responses/<response_id> is /v1/responses/{response_id}."""
    return _RULE_PARAMETER.sub(r"{\1}", rule)


def openapi_document(routes: list[tuple[str, str, str]], *, title: str, version: str, api_key: bool,
                     open_routes: frozenset[str] = frozenset(),
                     plugin_routes: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `routes` ((rule, method, view name) of the built-in routes served) and
    `plugin_routes` ((rule, method) an endpoint plugin serves). With `api_key` every route but
    `open_routes` requires `Authorization: Bearer KEY` and lists a 401."""
    missing = [name for _, _, name in routes if name not in CONTRACTS]
    if missing:  # a bug of ours: a route was added to routes._BUILTIN without its contract
        raise RuntimeError(f"the built-in routes {missing} have no Contract in asyncengine/server/openapi.py")
    types: list[Any] = [ErrorResponse]  # Structs and the other types msgspec writes a schema for
    for _, _, name in routes:
        contract = CONTRACTS[name]
        types += [t for t in (contract.request, contract.response, contract.stream_event) if t is not None]
    refs, components = msgspec.json.schema_components(types, ref_template=_REF)
    schema_of = dict(zip(types, refs))  # a type -> its schema ($ref to a component for a Struct)
    error_ref = schema_of[ErrorResponse]

    paths: dict[str, dict[str, Any]] = {}
    for rule, method, name in routes:
        contract = CONTRACTS[name]
        operation = _operation(name, contract, schema_of, error_ref, secured=api_key and rule not in open_routes)
        paths.setdefault(openapi_path(rule), {})[method.lower()] = {**operation, **_path_parameters(rule)}
    for rule, method in plugin_routes:
        paths.setdefault(openapi_path(rule), {})[method.lower()] = {
            "summary": "Added by an endpoint plugin (--plugins); its body is the plugin's own",
            "responses": {"default": {"description": "the plugin's answer"}},
            **({"security": [{"bearer": []}]} if api_key and rule not in open_routes else {}),
            **_path_parameters(rule),
        }
    document: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {"title": title, "version": version,
                 "description": "An OpenAI-compatible API served by asyncengine. Request bodies reject unknown "
                                "fields; every 4xx and 5xx body is ErrorResponse."},
        "paths": paths,
        "components": {"schemas": components},
    }
    if api_key:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                                                "description": "--api-key KEY"}}
    return document


def _path_parameters(rule: str) -> dict[str, Any]:
    parameters = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                  for name in _RULE_PARAMETER.findall(rule)]
    return {"parameters": parameters} if parameters else {}


def _operation(name: str, contract: Contract, schema_of: dict[Any, Any], error_ref: dict[str, Any], *,
               secured: bool) -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": error_ref}}}
    ok: dict[str, Any] = {"description": "OK"}
    if contract.response is not None:
        ok["content"] = {"application/json": {"schema": schema_of[contract.response]}}
    elif contract.response_media is not None:
        ok["content"] = {contract.response_media: {"schema": {"type": "string"}}}
    if contract.stream_event is not None:
        ok["description"] = "JSON; with `stream: true` server-sent events"
        ok.setdefault("content", {})["text/event-stream"] = {
            # OpenAPI 3.1 has no schema for one event; x-event-data names what each `data:` line holds.
            "schema": {"type": "string", "description": contract.stream_note},
            "x-event-data": schema_of[contract.stream_event],
        }
    responses: dict[str, Any] = {"200": ok}
    if secured:
        responses["401"] = {**error, "description": "missing or wrong API key"}
    if contract.request is not None:
        responses["415"] = {**error, "description": "the body is not sent as application/json"}
    responses["503"] = {**error, "description": "engine overloaded (with Retry-After) or dead, or a render server "
                                                "(no engine: code no_engine)"}
    responses["4XX"] = {**error, "description": "a bad request, in OpenAI's error shape (`param` names the field)"}
    responses["5XX"] = {**error, "description": "internal error (request id ...), in OpenAI's error shape"}
    operation: dict[str, Any] = {"operationId": name, "summary": contract.summary, "responses": responses}
    if contract.request is not None:
        operation["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": schema_of[contract.request]}}}
    if secured:
        operation["security"] = [{"bearer": []}]
    return operation

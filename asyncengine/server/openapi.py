"""The server's contract as an OpenAPI 3.2 document (`GET /openapi.json`), generated from the Structs.

Each built-in route has a `Contract` here: its request Struct (a JSON body), its response Struct, and
for the routes that stream, the Struct each server-sent event carries. `openapi_document` turns them
into one document with `msgspec.json.schema_components`, so the schemas are the very types the routes
decode and encode: a field added to a Struct is in the document, and a bound declared on it
(`msgspec.Meta(ge=..., le=...)`, or `request_bounds.limit` for one the configuration sets) becomes the
schema's minimum and maximum, with the value this server enforces. The document covers the app's URL map
(routes.publish_openapi): every route served is in it, and a route without a contract is an error when the
app is created, not a gap in the document; it is built on its first request (in a worker thread) and kept. Routes an endpoint plugin adds are
listed by path and method, without schemas (the plugin owns them).

Required fields: a request field without a default is required. A response Struct sends every field
(msgspec writes defaults too, unless the Struct says `omit_defaults`), so its schema marks them all required.

Streams (`"stream": true`): the 200 is `text/event-stream`, described as OpenAPI 3.2 describes sequential
media types, by `itemSchema`: the schema of one event, as an object `{"data": ...}` (the SSE fields; the
server sends no `event:`, `id:` or `retry:`). `data` is JSON (`contentMediaType: application/json`) whose
`contentSchema` is the route's chunk Struct, or an ErrorResponse for a failure after the stream began; the
last event of a stream that ended normally is `data: [DONE]`. The Responses API streams typed events
(`named_events`): each event has `event: TYPE` and a JSON `data` of its event Struct, and no `[DONE]`.

A few routes answer plain dicts rather than Structs (`/tokenize`, `/detokenize`, `/version`) and every
error is `{"error": {...}}` (server/errors.py): their shapes are declared below. tests/server/test_schemathesis.py
runs schemathesis against this document on a real server (every answer conforms: status, content type, schema).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Sequence
from typing import Any

import msgspec

from asyncengine.wire.startup import StartupRecord
from asyncengine.server import protocol, protocol_pooling, protocol_responses
from asyncengine.server.request_bounds import RequestBounds, bounded
from asyncengine.server.serving_lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

OPENAPI_VERSION = "3.2.0"
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


@dataclasses.dataclass(frozen=True)
class Contract:
    summary: str
    # Each of request, response and stream_event may be a tuple of types: the body is any one of them.
    request: Any = None  # the JSON body's Struct (POST routes)
    response: Any = None  # the 200 JSON body's type; None with `response_media` for a non-JSON body
    stream_event: Any = None  # with `stream: true` the 200 is server-sent events, each `data:` this (a type, or a
    # tuple of types: anyOf)
    named_events: bool = False  # each event is `event: TYPE` with its `data:`, and no `data: [DONE]` ends them
    response_media: str | None = None  # a 200 that is not JSON: its content type (a string body)
    examples: tuple[dict[str, Any], ...] = ()  # request bodies a client would send (the document's examples)


_CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]
_COMPLETION_EXAMPLES = ({"prompt": "The capital of France is", "max_tokens": 4},
                        {"prompt": ["Once upon a time", "The sky is"], "max_tokens": 4, "n": 2, "temperature": 0.7,
                         "stream": True, "stream_options": {"include_usage": True}})
_CHAT_EXAMPLES = ({"messages": _CHAT, "max_tokens": 4},
                  {"messages": _CHAT, "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 2, "stream": True,
                   "stream_options": {"include_usage": True}},
                  {"messages": _CHAT, "max_tokens": 12, "response_format": {"type": "json_schema", "json_schema": {
                      "name": "colour", "schema": {"type": "object", "properties": {"colour": {"type": "string"}},
                                                   "required": ["colour"]}}}})
_RESPONSES_EXAMPLES = ({"input": "Name a colour.", "instructions": "Answer briefly.", "max_output_tokens": 8},
                       {"input": [{"role": "user", "content": "Name a colour."}], "max_output_tokens": 8,
                        "stream": True},
                       {"input": "Name a colour.", "max_output_tokens": 16, "text": {"format": {
                           "type": "json_schema", "name": "colour", "schema": {
                               "type": "object", "properties": {"colour": {"type": "string"}},
                               "required": ["colour"]}}}})
_RERANK_EXAMPLES = ({"query": "pets", "documents": ["A cat sat on the mat.", "Stocks fell."], "top_n": 1},)
_SCORE_EXAMPLES = ({"text_1": "A cat", "text_2": ["A kitten", "A car"]},
                   {"queries": "A cat", "documents": ["A kitten", "A car"]})
# /invocations takes the body of any of the routes it chooses among (server/invocations.py).
# (a tuple: any one of them; msgspec makes no union of untagged Structs)
_INVOCATION_REQUESTS = (protocol.ChatCompletionRequest, protocol.CompletionRequest, protocol_pooling.EmbeddingRequest,
                        protocol_pooling.ClassificationRequest, protocol_pooling.ScoreRequest,
                        protocol_pooling.RerankRequest)
_INVOCATION_RESPONSES = (protocol.ChatCompletionResponse, protocol.CompletionResponse,
                         protocol_pooling.EmbeddingResponse, protocol_pooling.ClassificationResponse,
                         protocol_pooling.ScoreResponse, protocol_pooling.RerankResponse)


# Keyed by the view name (the URL map's endpoint) of routes._BUILTIN and serving_lora.LORA_ROUTES.
CONTRACTS: dict[str, Contract] = {
    "models": Contract("The served model", response=protocol.ModelList),
    "completions": Contract("Text completions (OpenAI's /v1/completions)", request=protocol.CompletionRequest,
                            response=protocol.CompletionResponse, stream_event=protocol.CompletionResponse,
                            examples=_COMPLETION_EXAMPLES),
    "chat_completions": Contract("Chat completions (OpenAI's /v1/chat/completions)",
                                 request=protocol.ChatCompletionRequest, response=protocol.ChatCompletionResponse,
                                 stream_event=protocol.ChatCompletionChunk, examples=_CHAT_EXAMPLES),
    "completions_render": Contract("A completion request rendered and tokenized, not run (vLLM's; one per prompt)",
                                   request=protocol.CompletionRequest, response=list[protocol.RenderedRequest],
                                   examples=_COMPLETION_EXAMPLES[:1]),
    "chat_completions_render": Contract("A chat request through the chat template and tokenized, not run (vLLM's)",
                                        request=protocol.ChatCompletionRequest, response=protocol.RenderedRequest,
                                        examples=_CHAT_EXAMPLES[:1]),
    "io_process": Contract("The IO processor chosen by --io-processor-plugin", request=protocol.IOProcessRequest,
                           response=protocol.IOProcessResponse),
    "startup": Contract("The start-up report of every process", response=list[StartupRecord]),
    "tokenize": Contract("Tokenize a prompt, or chat messages through the chat template",
                         request=protocol.TokenizeRequest, response=TokenizeResponse,
                         examples=({"prompt": "Hello world"}, {"messages": _CHAT, "add_generation_prompt": True})),
    "detokenize": Contract("Token ids to text", request=protocol.DetokenizeRequest, response=DetokenizeResponse,
                           examples=({"tokens": [1, 2, 3]},)),
    "health": Contract("200 (an empty body) while the engine serves; 503 when it is dead or shutting down",
                       response_media="text/plain"),
    "metrics": Contract("Prometheus metrics", response_media="text/plain; version=0.0.4"),
    "version": Contract("The asyncengine version", response=VersionResponse),
    "openapi": Contract("This document: the server's contract, OpenAPI 3.2", response=dict[str, Any]),
    # Pooling models (docs/pooling.md; server/serving_pooling.py).
    "embeddings": Contract("Embeddings (OpenAI's /v1/embeddings)", request=protocol_pooling.EmbeddingRequest,
                           response=protocol_pooling.EmbeddingResponse,
                           examples=({"input": ["A cat sat on the mat.", "Stocks fell."]},
                                     {"input": "A cat.", "encoding_format": "base64"})),
    "pooling": Contract("The pooler's output, or an IO processor's response over pooled outputs",
                        request=protocol_pooling.PoolingRequest,
                        response=protocol_pooling.PoolingResponse | protocol_pooling.PoolingIOResponse,
                        examples=({"input": "A cat sat on the mat."},)),
    "classify": Contract("Class probabilities of a classification model", request=protocol_pooling.ClassificationRequest,
                         response=protocol_pooling.ClassificationResponse,
                         examples=({"input": ["What a great film!"]},)),
    "score": Contract("Scores of text pairs (a cross-encoder, or the cosine of two embeddings)",
                      request=protocol_pooling.ScoreRequest, response=protocol_pooling.ScoreResponse,
                      examples=_SCORE_EXAMPLES),
    "rerank": Contract("Documents ranked against a query (Jina's and Cohere's shape)",
                       request=protocol_pooling.RerankRequest, response=protocol_pooling.RerankResponse,
                       examples=_RERANK_EXAMPLES),
    "v1_rerank": Contract("Documents ranked against a query (as /rerank)", request=protocol_pooling.RerankRequest,
                          response=protocol_pooling.RerankResponse, examples=_RERANK_EXAMPLES),
    "v2_rerank": Contract("Documents ranked against a query (Cohere's v2 rerank; as /rerank)",
                          request=protocol_pooling.RerankRequest, response=protocol_pooling.RerankResponse,
                          examples=_RERANK_EXAMPLES),
    "v1_score": Contract("Scores of text pairs (as /score)", request=protocol_pooling.ScoreRequest,
                         response=protocol_pooling.ScoreResponse, examples=_SCORE_EXAMPLES),
    "v2_embed": Contract("Embeddings in Cohere's v2 embed shape (float, base64, binary, ubinary)",
                         request=protocol_pooling.CohereEmbedRequest, response=protocol_pooling.CohereEmbedResponse,
                         examples=({"texts": ["A cat sat on the mat."], "input_type": "search_document",
                                    "embedding_types": ["float"]},)),
    # SageMaker's: /ping is /health's answer; /invocations answers as the route the body's fields choose.
    "ping": Contract("SageMaker's health check: as /health", response_media="text/plain"),
    "ping_post": Contract("SageMaker's health check: as /health (no body is read)", response_media="text/plain"),
    "invocations": Contract("SageMaker's single route: chat (`messages`), completions (`prompt`), embeddings or "
                            "classification (`input`), score (a score pair) or rerank (`query`, `documents`), "
                            "chosen by the body's fields", request=_INVOCATION_REQUESTS,
                            response=_INVOCATION_RESPONSES,
                            stream_event=(protocol.ChatCompletionChunk, protocol.CompletionResponse),
                            examples=(_CHAT_EXAMPLES[0], _COMPLETION_EXAMPLES[0], _RERANK_EXAMPLES[0])),
    "docs": Contract("This document as a web page (self-contained: no CDN)", response_media="text/html"),
    # Runtime LoRA updates (--enable-runtime-lora-updates; server/serving_lora.py): vLLM's plain-text answers.
    "load_lora_adapter": Contract("Load a LoRA adapter and serve it under `lora_name` (vLLM's)",
                                  request=LoadLoRAAdapterRequest, response_media="text/plain",
                                  examples=({"lora_name": "my-adapter", "lora_path": "/models/my-adapter"},)),
    "unload_lora_adapter": Contract("Unload a LoRA adapter loaded by name (vLLM's)",
                                    request=UnloadLoRAAdapterRequest, response_media="text/plain",
                                    examples=({"lora_name": "my-adapter"},)),
    # OpenAI's Responses API (docs/server.md; server/serving_responses.py).
    "responses_create": Contract("A response (OpenAI's Responses API); streamed as typed events",
                                 request=protocol_responses.ResponsesRequest,
                                 response=protocol_responses.ResponsesResponse,
                                 stream_event=protocol_responses.ResponseStreamEvent, named_events=True,
                                 examples=_RESPONSES_EXAMPLES),
    "responses_retrieve": Contract("A stored response (store: true), by id",
                                   response=protocol_responses.ResponsesResponse),
    "responses_cancel": Contract("Cancel a background response (no body)",
                                 response=protocol_responses.ResponsesResponse),
}


def openapi_document(routes: Sequence[tuple[str, str, str]], *, title: str, version: str, api_key: bool,
                     open_routes: frozenset[str] = frozenset(),
                     plugin_routes: Sequence[tuple[str, str]] = (),
                     bounds: RequestBounds | None = None, strict_fields: bool = False) -> dict[str, Any]:
    """The OpenAPI 3.2 document of `routes` ((rule, method, view name) of the built-in routes served) and
    `plugin_routes` ((rule, method) an endpoint plugin serves). Request schemas carry `bounds` (this
    server's limits; without them, the fallback int64 bounds). With `api_key` every route but
    `open_routes` requires `Authorization: Bearer KEY` and lists a 401. A request body's own schema
    allows properties it does not declare (the server ignores them: request_fields.py) unless
    `strict_fields` (--strict-request-fields); the objects nested in it never do."""
    check_contracts(routes)
    contracts = {name: _bounded_contract(CONTRACTS[name], bounds) for _, _, name in routes}
    requests = [m for c in contracts.values() for m in any_of(c.request)]
    responses = [ErrorResponse, *(m for c in contracts.values() for t in (c.response, c.stream_event)
                                  for m in any_of(t))]
    structs = sorted(_structs_in(requests + responses), key=lambda cls: cls.__name__)
    types = [*requests, *responses, *structs]
    refs, components = msgspec.json.schema_components(types, ref_template=_REF)
    schema_of = _SchemaOf(zip(types, refs))  # a type -> its schema ($ref to a component for a Struct)
    _mark_sent_fields_required(components, schema_of, requests, responses)
    if not strict_fields:
        for request in requests:
            components[request.__name__].pop("additionalProperties", None)

    paths: dict[str, dict[str, Any]] = {}
    for rule, method, name in routes:
        path, parameters = _openapi_path(rule)
        paths.setdefault(path, {})[method.lower()] = _operation(name, contracts[name], schema_of, parameters,
                                                                secured=api_key and rule not in open_routes)
    for rule, method in plugin_routes:
        path, parameters = _openapi_path(rule)
        paths.setdefault(path, {})[method.lower()] = {
            "summary": "Added by an endpoint plugin (--plugins); its body is the plugin's own",
            **({"parameters": parameters} if parameters else {}),
            "responses": {"default": {"description": "the plugin's answer"}},
            **({"security": [{"bearer": []}]} if api_key and rule not in open_routes else {}),
        }
    document: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {"title": title, "version": version,
                 "description": "An OpenAI-compatible API served by asyncengine. "
                                + ("Request bodies reject unknown fields; " if strict_fields else
                                   "A request body's unknown top-level fields are ignored and named in the "
                                   "X-Ignored-Fields response header (--strict-request-fields refuses them); ")
                                + "every 4xx and 5xx body is ErrorResponse. With `stream: true` a 200 is "
                                "server-sent events (text/event-stream; itemSchema is one event)."},
        "paths": paths,
        "components": {"schemas": components},
    }
    if api_key:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                                                "description": "--api-key KEY"}}
    return document


def any_of(tp: Any) -> tuple[Any, ...]:
    """The types a Contract's field names: the tuple's, the one type, or none for None."""
    return tp if isinstance(tp, tuple) else () if tp is None else (tp,)


class _SchemaOf(dict[Any, Any]):
    """A type's schema; a tuple of types: anyOf their schemas."""

    def __getitem__(self, tp: Any) -> Any:
        if isinstance(tp, tuple):
            return {"anyOf": [super(_SchemaOf, self).__getitem__(member) for member in tp]}
        return super().__getitem__(tp)


def check_contracts(routes: Sequence[tuple[str, str, str]]) -> None:
    """RuntimeError when a route's view has no Contract (a bug of ours: a route added without its contract)."""
    missing = sorted({name for _, _, name in routes if name not in CONTRACTS})
    if missing:
        raise RuntimeError(f"the routes of the views {missing} have no Contract in asyncengine/server/openapi.py")


def _bounded_contract(contract: Contract, bounds: RequestBounds | None) -> Contract:
    if contract.request is None or bounds is None:
        return contract
    members = tuple(bounded(member, bounds) for member in any_of(contract.request))
    return dataclasses.replace(contract, request=members if isinstance(contract.request, tuple) else members[0])


def _structs_in(types: Sequence[Any]) -> set[type]:
    """Every Struct class the types hold, through their fields, unions and containers."""
    found: set[type] = set()
    stack = list(types)
    while stack:
        tp = stack.pop()
        if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
            if tp in found:
                continue
            found.add(tp)
            stack += [info.type for info in msgspec.structs.fields(tp)]
        else:
            stack += [arg for arg in typing.get_args(tp) if not isinstance(arg, msgspec.Meta)]
    return found


def _mark_sent_fields_required(components: dict[str, Any], schema_of: dict[Any, Any], requests: list[type],
                               responses: list[Any]) -> None:
    """A Struct the server only sends writes every field (unless it omits defaults): all required. One that
    requests use too keeps msgspec's rule (a field with a default is optional)."""
    received = _structs_in(requests)
    for cls in _structs_in(responses) - received:
        if cls.__struct_config__.omit_defaults:  # type: ignore[attr-defined]
            continue
        component = components.get(schema_of[cls]["$ref"].rsplit("/", 1)[-1])
        if component is not None and "properties" in component:
            component["required"] = list(component["properties"])


_VARIABLE = re.compile(r"<(?:[^:<>]+:)?([^<>]+)>")


def _openapi_path(rule: str) -> tuple[str, list[dict[str, Any]]]:
    """werkzeug's `/a/<int:b>` as OpenAPI's `/a/{b}`, with its path parameters."""
    names = _VARIABLE.findall(rule)
    parameters = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}} for name in names]
    return _VARIABLE.sub(r"{\1}", rule), parameters


def _operation(name: str, contract: Contract, schema_of: dict[Any, Any], parameters: list[dict[str, Any]], *,
               secured: bool) -> dict[str, Any]:
    error_ref = schema_of[ErrorResponse]
    error = {"content": {"application/json": {"schema": error_ref}}}
    ok: dict[str, Any] = {"description": "OK"}
    if contract.response is not None:
        ok["content"] = {"application/json": {"schema": schema_of[contract.response]}}
    elif contract.response_media is not None:
        ok["content"] = {contract.response_media: {"schema": {"type": "string"}}}
    if contract.stream_event is not None:
        ok["description"] = "JSON; with `stream: true` server-sent events"
        event = _named_event_schema if contract.named_events else _event_schema
        ok.setdefault("content", {})["text/event-stream"] = {"itemSchema": event(
            schema_of[contract.stream_event], error_ref)}
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
    if parameters:
        operation["parameters"] = parameters
    if contract.request is not None:
        body: dict[str, Any] = {"schema": schema_of[contract.request]}
        if contract.examples:
            body["examples"] = {f"example{i}": {"value": value} for i, value in enumerate(contract.examples, 1)}
        operation["requestBody"] = {"required": True, "content": {"application/json": body}}
    if secured:
        operation["security"] = [{"bearer": []}]
    return operation


def _event_schema(chunk_ref: dict[str, Any], error_ref: dict[str, Any]) -> dict[str, Any]:
    """One server-sent event of a stream, as the SSE fields parse it (`data` is the text after `data: `)."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [
            {"const": "[DONE]", "description": "The last event of a stream that ended normally."},
            {"type": "string", "contentMediaType": "application/json",
             "contentSchema": {"anyOf": [chunk_ref, error_ref]},
             "description": "A chunk; or an ErrorResponse, the last event of a stream that failed after it began."},
        ]}},
    }


def _named_event_schema(event_ref: dict[str, Any], error_ref: dict[str, Any]) -> dict[str, Any]:
    """One server-sent event of a stream of typed events (the Responses API's): `event` names the type that
    `data` (JSON) holds, numbered by its sequence_number; a failure after the stream began is an `error`
    event then `response.failed`; no `[DONE]` ends the stream (OpenAI sends none)."""
    return {
        "type": "object",
        "required": ["event", "data"],
        "properties": {
            "event": {"type": "string", "description": "The event's type, as its data's `type` says."},
            "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": event_ref},
        },
    }

"""The built-in routes: the OpenAI API under /v1 (and /v1/io_process for an IO processor plugin), vLLM's
render routes (/v1/chat/completions/render, /v1/completions/render: serving_render.py), and /tokenize,
/detokenize, /health, /metrics, /version, /openapi.json (the contract, server/openapi.py) with /docs (its page,
docs_page.py); SageMaker's /ping (GET and POST: /health's answer) and /invocations (invocations.py).

Over a client without an engine (the render server, render_server.py) the routes that generate or pool
answer 503 with code `no_engine`; the others answer as they do over an engine."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Collection
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from quart import Response, g, request

from asyncengine.errors import RequestError
from asyncengine.server import request_fields
from asyncengine.server.access import PUBLIC_PATHS
from asyncengine.server.common import (
    ServingContext, chat_prompt_text, check_model, request_chat_template, tokenize_prompt,
)
from asyncengine.server.config import ServerConfig
from asyncengine.server.docs_page import DOCS_HTML
from asyncengine.server.errors import (
    ApiError, bad_request, from_engine_error, from_validation_error, too_deep,
)
from asyncengine.server.openapi import CONTRACTS, any_of, check_contracts, openapi_document
from asyncengine.server.protocol import (
    ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse, DetokenizeRequest,
    IOProcessRequest, ModelCard, ModelList, TokenizeRequest,
)
from asyncengine.server.invocations import invocation_view
from asyncengine.sampling_bounds import RequestBounds
from asyncengine.server.request_bounds import bounded
from asyncengine.server.serving_chat import create_chat_completion, message_dicts
from asyncengine.server.serving_completions import create_completion
from asyncengine.server.response_scope import current_response_scope
from asyncengine.server.serving_io_processor import create_io_process
from asyncengine.server.serving_lora import add_lora_routes, model_cards, runtime_updates_enabled
from asyncengine.server.serving_pooling import POOLING_ROUTES, pooling_views
from asyncengine.server.serving_render import render_chat_request, render_completion_request
from asyncengine.server.serving_responses import RESPONSES_ROUTES, responses_views
from asyncengine.server.responses_store import ResponseStore

if TYPE_CHECKING:
    from asyncengine.frontend.engine_client import EngineClient

# (rule, method) of every built-in route: an endpoint plugin that adds one of these must say override.
_BUILTIN: list[tuple[str, str, str]] = [
    ("/v1/models", "GET", "models"),
    ("/v1/completions", "POST", "completions"),
    ("/v1/chat/completions", "POST", "chat_completions"),
    ("/v1/completions/render", "POST", "completions_render"),
    ("/v1/chat/completions/render", "POST", "chat_completions_render"),
    ("/v1/io_process", "POST", "io_process"),
    ("/v1/startup", "GET", "startup"),
    ("/tokenize", "POST", "tokenize"),
    ("/detokenize", "POST", "detokenize"),
    ("/health", "GET", "health"),
    ("/ping", "GET", "ping"),  # SageMaker's health check (vLLM serves both methods)
    ("/ping", "POST", "ping_post"),
    ("/invocations", "POST", "invocations"),
    ("/metrics", "GET", "metrics"),
    ("/version", "GET", "version"),
    ("/openapi.json", "GET", "openapi"),
    ("/docs", "GET", "docs"),
    *POOLING_ROUTES,  # /v1/embeddings, /pooling, /classify, /score, /rerank, /v1/rerank (serving_pooling.py)
    *RESPONSES_ROUTES,  # /v1/responses, GET /v1/responses/{id}, POST .../cancel (serving_responses.py)
]


# The views that run the engine: a client without one (render_server.py) answers them 503.
# (/invocations answers with the view it chooses, so as that view does.)
ENGINE_VIEWS = frozenset({"completions", "chat_completions", "io_process", "responses_create",
                          *(name for _, _, name in POOLING_ROUTES)})


def builtin_route_keys() -> list[tuple[str, str]]:
    return [(rule, method) for rule, method, _ in _BUILTIN]


def json_response(value: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status=status, content_type="application/json")


def sse_response(events: AsyncIterator[bytes]) -> Response:
    response = Response(events, content_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    response.timeout = None  # a stream lasts as long as its generation
    return response


async def decode_body(struct: type, bounds: RequestBounds | None = None, *, strict: bool = False) -> Any:
    """The request's JSON body as `struct`, with this server's `bounds` on its fields (request_bounds.py).
    Unknown top-level fields are a 400 when `strict` (--strict-request-fields), else ignored and named in
    X-Ignored-Fields, as are the declared fields without effect that the body sets (request_fields.py)."""
    struct = bounded(struct, bounds)
    body = await request.get_data(cache=False, as_text=False, parse_form_data=False)  # 413 past MAX_CONTENT_LENGTH
    if not body:
        raise bad_request("the request has no body: send a JSON object", code="invalid_json")
    try:
        decoded, unknown = request_fields.decode(body, struct, strict=strict)
    except msgspec.DecodeError as error:  # ValidationError is a DecodeError too
        raise from_validation_error(error, struct) from error
    except RecursionError as error:  # a field typed Any, nested deeper than msgspec decodes
        raise too_deep(body) from error
    if unknown:
        request_fields.warn_unknown(unknown, request.path)
    ignored = unknown + request_fields.ignored_known(decoded)
    if ignored:
        g.ignored_fields = ignored  # the response's X-Ignored-Fields (app.py)
    return decoded


def add_builtin_routes(app: Any, context: ServingContext, metrics: Any, *, skip: set[tuple[str, str]]) -> None:
    engine = context.engine
    has_engine = getattr(engine, "has_engine", True)
    created = int(time.time())
    bounds = RequestBounds.of(engine.config, engine.model_config)
    for contract in CONTRACTS.values():  # each request Struct with this server's bounds, made now, not by a request
        for struct in any_of(contract.request):
            bounded(struct, bounds)
    server_config = app.extensions.get("asyncengine", {}).get("server_config")
    decode = partial(decode_body, bounds=bounds,
                     strict=bool(server_config is not None and server_config.strict_request_fields))

    async def models() -> Response:
        cards = [ModelCard(id=name, created=created, max_model_len=context.max_model_len, root=engine.config.model)
                 for name in (context.model_name, *context.model_aliases)]
        return json_response(ModelList(data=[*cards, *model_cards(context, created)]))

    async def completions() -> Response:
        body = await decode(CompletionRequest)
        result = await create_completion(context, body, g.request_id, current_response_scope())
        return json_response(result) if isinstance(result, CompletionResponse) else sse_response(result)

    async def chat_completions() -> Response:
        body = await decode(ChatCompletionRequest)
        result = await create_chat_completion(context, body, g.request_id, current_response_scope())
        return json_response(result) if isinstance(result, ChatCompletionResponse) else sse_response(result)

    async def completions_render() -> Response:
        body = await decode(CompletionRequest)
        return json_response(await render_completion_request(context, body, g.request_id))

    async def chat_completions_render() -> Response:
        body = await decode(ChatCompletionRequest)
        return json_response(await render_chat_request(context, body, g.request_id))

    async def io_process() -> Response:
        body = await decode(IOProcessRequest)
        return json_response(await create_io_process(context, body, g.request_id))

    async def startup() -> Response:
        return json_response(engine.startup_report)

    async def tokenize() -> Response:
        body = await decode(TokenizeRequest)
        check_model(context, body.model)
        _tokenizer(engine)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of 'prompt' and 'messages'", param="prompt")
        # Tokenizing and rendering run in the engine's tokenizer pool, off the event loop.
        if body.prompt is not None:
            tokens = await tokenize_prompt(engine, body.prompt, add_special_tokens=body.add_special_tokens is not False)
        else:
            text = await chat_prompt_text(engine, message_dicts(body.messages),
                                          chat_template=request_chat_template(context, body.chat_template),
                                          add_generation_prompt=body.add_generation_prompt,
                                          continue_final_message=body.continue_final_message,
                                          template_kwargs=body.chat_template_kwargs)
            tokens = await tokenize_prompt(engine, text, add_special_tokens=bool(body.add_special_tokens))
        result: dict[str, Any] = {"count": len(tokens), "max_model_len": context.max_model_len, "tokens": tokens}
        if body.return_token_strs:  # vLLM's: the tokenizer's own pieces ("Ġworld"), not decoded text
            result["token_strs"] = await engine.tokenizer_pool.run(_token_strs, engine.tokenizer, tokens)
        return json_response(result)

    async def detokenize() -> Response:
        body = await decode(DetokenizeRequest)
        check_model(context, body.model)
        _tokenizer(engine)
        try:  # checked and decoded in the engine's tokenizer pool, off the event loop
            return json_response({"prompt": await engine.detokenize(body.tokens)})
        except RequestError as error:
            raise from_engine_error(error) from error

    async def health() -> Response:
        if engine.dead_error is not None:
            raise ApiError(503, f"the engine is dead: {engine.dead_error}", type="service_unavailable",
                           code="engine_dead")
        if not engine.is_running:
            raise ApiError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")
        return Response("", status=200, content_type="text/plain")

    async def metrics_route() -> Response:
        if has_engine:
            for index in engine.dead_engine_indexes():  # engine_up 0 and its gauges zeroed, never stale
                metrics.mark_engine_dead(index)
            if engine.dead_error is None:
                metrics.update_scheduler_stats(await engine.get_scheduler_stats())  # current even when idle
        # Off the event loop: with vLLM's names beside ours the text is some 70 KB, tens of ms to write.
        body, content_type = await anyio.to_thread.run_sync(metrics.render)
        return Response(body, status=200, content_type=content_type)

    async def version() -> Response:
        from asyncengine import __version__

        return json_response({"version": __version__})

    served = [(rule, method, name) for rule, method, name in _BUILTIN if (rule, method) not in skip]

    async def openapi() -> Response:  # the document of every route, built once (publish_openapi)
        return Response(await app.extensions["asyncengine"]["openapi"].encoded(), status=200,
                        content_type="application/json")

    async def docs() -> Response:
        return Response(DOCS_HTML, status=200, content_type="text/html; charset=utf-8",
                        headers={"Content-Security-Policy": _DOCS_CSP})

    async def invocations() -> Response:
        # The body stays cached here (cache=True), for the chosen view to decode whole.
        body = await request.get_data(cache=True, as_text=False, parse_form_data=False)
        pooling_task = engine.pooling_task_default() if has_engine and engine.model_config.pooler else None
        return await views[invocation_view(body, pooling_task)]()

    views: dict[str, Callable[[], Any]] = {
        "models": models, "completions": completions, "chat_completions": chat_completions, "io_process": io_process,
        "startup": startup, "tokenize": tokenize, "detokenize": detokenize, "health": health, "ping": health,
        "ping_post": health, "metrics": metrics_route, "version": version, "openapi": openapi, "docs": docs,
        "invocations": invocations, "completions_render": completions_render,
        "chat_completions_render": chat_completions_render}
    views.update(pooling_views(context, decode, json_response))
    server_config = app.extensions.get("asyncengine", {}).get("server_config") or ServerConfig()
    store = ResponseStore(server_config.responses_store_max_entries, server_config.responses_store_max_bytes)
    views.update(responses_views(app, context, store, decode, json_response, sse_response))
    if not has_engine:
        views.update({name: _no_engine(rule) for rule, _, name in _BUILTIN if name in ENGINE_VIEWS})
    for rule, method, name in served:
        app.add_url_rule(rule, name, views[name], methods=[method])
    if has_engine and runtime_updates_enabled(server_config) and getattr(engine, "lora_adapters", None) is not None:
        add_lora_routes(app, context, decode)


# The /docs page runs its own inline script and reads only this server's /openapi.json.
_DOCS_CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'"


def _no_engine(rule: str) -> Any:
    async def no_engine(**_: Any) -> Response:
        raise ApiError(503, f"{rule} needs an engine, and this is a render server (asyncengine launch render), which "
                            "renders and tokenizes only: send it to a server started with `asyncengine serve`",
                       type="service_unavailable", code="no_engine")

    return no_engine


def served_routes(app: Any) -> list[tuple[str, str, str]]:
    """(rule, method, endpoint) of every route the app serves (HEAD and OPTIONS, which Quart adds to every
    route, aside)."""
    return [(rule.rule, method, rule.endpoint) for rule in app.url_map.iter_rules()
            for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"})]


def publish_openapi(app: Any, engine_client: EngineClient, plugin_routes: Collection[tuple[str, str]]) -> None:
    """Make /openapi.json the document of every route in the app's URL map, once they are all added: the
    routes endpoint plugins added (`plugin_routes`: (rule, method)) without schemas, every other route by its
    view's Contract (a route without one is a RuntimeError here, at start-up), request bounds this server's.
    The document itself is built on its first request, in a worker thread (its schemas take a few hundred
    ms to generate: not on the event loop), and kept."""
    from asyncengine import __version__

    routes = [(rule, method, name) for rule, method, name in served_routes(app) if (rule, method) not in plugin_routes]
    plugins = [(rule, method) for rule, method, _ in served_routes(app) if (rule, method) in plugin_routes]
    check_contracts(routes)
    server_config = app.extensions["asyncengine"].get("server_config")
    app.extensions["asyncengine"]["openapi"] = OpenApiDocument(partial(
        openapi_document, routes, title="asyncengine", version=__version__, plugin_routes=plugins,
        api_key=bool(server_config is not None and server_config.api_key),
        open_routes=PUBLIC_PATHS,  # served without the key (access.py)
        bounds=RequestBounds.of(engine_client.config, engine_client.model_config),
        strict_fields=bool(server_config is not None and server_config.strict_request_fields)))


class OpenApiDocument:
    """The encoded document, built once, when first asked for."""

    def __init__(self, build: Callable[[], dict[str, Any]]) -> None:
        self.build = build
        self._encoded: bytes | None = None

    async def encoded(self) -> bytes:
        if self._encoded is None:  # (two first requests at once both build it: the same bytes)
            self._encoded = await anyio.to_thread.run_sync(lambda: msgspec.json.encode(self.build()))
        return self._encoded


def _token_strs(tokenizer: Any, tokens: list[int]) -> list[str]:
    """Each token's own piece (transformers' convert_ids_to_tokens), else its decoded text (a tokenizer plugin)."""
    pieces = getattr(tokenizer, "convert_ids_to_tokens", None)
    return list(pieces(tokens)) if pieces is not None else [tokenizer.decode([token]) for token in tokens]


def _tokenizer(engine: EngineClient) -> Any:
    if engine.tokenizer is None:
        raise bad_request("this server runs with skip_tokenizer_init: there is no tokenizer", code="no_tokenizer")
    return engine.tokenizer

"""create_app(engine_client, config): the OpenAI-compatible API as a QuartTrio app.

Embeddable: give it a started AsyncEngine and serve it with any ASGI server running on trio (the
`asyncengine serve` command uses Hypercorn's trio worker). Endpoint plugins attach their routes here,
before the built-in ones, so a clash is seen and named; their background tasks start in the app's
task group when it starts serving. `--middleware` wraps the app (an ASGI middleware class) or the
dispatch of each request (an async function `(request, call_next)`).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope
from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from asyncengine.errors import StartupError
from asyncengine.server import access, request_fields, routes
from asyncengine.server.common import ServingContext
from asyncengine.server.config import ServerConfig
from asyncengine.server.errors import ApiError
from asyncengine.server.fastapi_endpoints import served_endpoint_plugins
from asyncengine.server.metrics import PrometheusStatLogger
from asyncengine.server.response_scope import ResponseScopedConnection
from asyncengine.interfaces.io_processor import Renderer
from asyncengine.server.serving_io_processor import select_io_processor
from asyncengine.server.transport import ResponseCounter, end_of_response_shielded
from asyncengine.server.parsers.selection import configured_reasoning_parser, configured_tool_parser

if TYPE_CHECKING:
    from asyncengine.frontend.engine_client import EngineClient

logger = logging.getLogger("asyncengine.server")
# One line per request (--disable-log-requests: none; --enable-log-requests: and its body), at INFO;
# --uvicorn-log-level sets this logger's level with Hypercorn's (run.py).
REQUEST_LOGGER = "asyncengine.server.requests"
request_log = logging.getLogger(REQUEST_LOGGER)


class ApiApp(QuartTrio):
    """QuartTrio with function middleware around each request's dispatch, connections that close as
    HTTP says, and a count of the responses in flight (server/transport.py)."""

    http_middlewares: list[Callable[..., Awaitable[Any]]]
    responses: ResponseCounter
    # Each request handled, body included, inside a scope that owns what serves it (response_scope.py).
    asgi_http_class = ResponseScopedConnection

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] != "http":
            return await super().__call__(scope, receive, send)
        self.responses.started()
        try:
            await super().__call__(scope, receive, end_of_response_shielded(send))
        finally:
            self.responses.finished()

    async def full_dispatch_request(self, request_context: Any = None) -> Any:
        dispatch = super().full_dispatch_request
        chain = lambda _request=None: dispatch(request_context)  # noqa: E731
        for middleware in reversed(self.http_middlewares):
            chain = _bind(middleware, chain)
        return await chain(request)


def _bind(middleware: Callable[..., Awaitable[Any]], call_next: Callable[..., Awaitable[Any]]):
    async def run(_request: Any = None) -> Any:
        return await middleware(request, call_next)

    return run


def create_app(engine_client: EngineClient, config: ServerConfig | None = None) -> ApiApp:
    """The API over `engine_client` (a started AsyncEngine, or the render server's RenderClient, whose
    `has_engine` is False: server/render_server.py). Raises StartupError when a parser, a
    middleware, an endpoint plugin or the IO processor cannot be used, naming it (ConfigError when
    --io-processor-plugin names no installed, allowed IO processor)."""
    config = config or ServerConfig()
    app = ApiApp("asyncengine.server", static_folder=None)  # serves no files: every route is in /openapi.json
    # BODY_TIMEOUT: Quart's own, from the moment a route reads the body; it bounds an embedder's server.
    # `asyncengine serve` enforces the same limit from the request's head on (server/body_deadline.py).
    app.config.update(MAX_CONTENT_LENGTH=config.max_request_body_bytes, RESPONSE_TIMEOUT=None,
                      BODY_TIMEOUT=config.request_body_timeout,
                      BACKGROUND_TASK_SHUTDOWN_TIMEOUT=config.shutdown_grace_period)
    app.http_middlewares = []
    app.responses = ResponseCounter()
    model_config = engine_client.model_config
    context = ServingContext(
        engine=engine_client, model_name=model_config.served_model_name, max_model_len=model_config.max_model_len,
        model_aliases=tuple(engine_client.config.served_model_names[1:]),
        chat_template=engine_client.chat_template, enable_auto_tool_choice=config.enable_auto_tool_choice,
        trust_request_chat_template=config.trust_request_chat_template,
        enable_prompt_tokens_details=config.enable_prompt_tokens_details,
        tool_parser=configured_tool_parser(config), reasoning_parser=configured_reasoning_parser(config),
        io_processor=select_io_processor(engine_client.config,
                                         dict(getattr(engine_client.plugins, "io_processors", {})),
                                         Renderer(getattr(engine_client, "tokenizer", None),
                                                  engine_client.config.model_config)),
    )
    metrics = PrometheusStatLogger(engine_client.config, model_name=context.model_name,
                                   max_model_len=model_config.max_model_len)
    has_engine = getattr(engine_client, "has_engine", True)
    if has_engine:  # without an engine there are no steps to count
        engine_client.add_stat_logger(metrics)
    app.extensions["asyncengine"] = {"context": context, "metrics": metrics, "server_config": config}

    # vLLM's form (attach_router, a FastAPI router) is mounted as an ASGI app (fastapi_endpoints.py).
    endpoint_plugins = served_endpoint_plugins(list(getattr(engine_client.plugins, "endpoints", [])),
                                               engine_client, config)
    plugin_routes = _attach_endpoint_plugins(app, endpoint_plugins)
    routes.add_builtin_routes(app, context, metrics, skip=_overridden_builtins(plugin_routes))
    routes.publish_openapi(app, engine_client, plugin_routes)  # every route is added now
    _add_hooks(app, config)
    _apply_middleware(app, config.middleware)

    @app.before_serving
    async def start_endpoint_plugins() -> None:
        for plugin in endpoint_plugins:  # each one's background work, owned by the app's task group
            # A render server has no engine client to give (vLLM's init_state(None, ...) there).
            await app.nursery.start(plugin.serve, engine_client if has_engine else None)

    return app


# -- endpoint plugins ------------------------------------------------------------------------------------

_IMPLICIT_METHODS = {"HEAD", "OPTIONS"}


def _route_keys(app: ApiApp) -> list[tuple[str, str]]:
    return [(rule.rule, method) for rule in app.url_map.iter_rules()
            for method in sorted((rule.methods or set()) - _IMPLICIT_METHODS)]


def _attach_endpoint_plugins(app: ApiApp, plugins: list[Any]) -> dict[tuple[str, str], Any]:
    """Attach each plugin's routes (before the built-in ones exist); (rule, method) -> its plugin."""
    owners: dict[tuple[str, str], Any] = {}
    for plugin in plugins:
        before = len(_route_keys(app))
        try:
            plugin.attach(app)
        except StartupError:
            raise  # says what was wrong already, naming the plugin
        except Exception as exc:  # the plugin's own failure, named
            raise StartupError(f"endpoint plugin {plugin.name!r} failed in attach(app): "
                               f"{type(exc).__name__}: {exc}") from exc
        for key in _route_keys(app)[before:]:  # werkzeug keeps rules in the order they were added
            if key in owners:
                raise StartupError(f"endpoint plugins {owners[key].name!r} and {plugin.name!r} both add the route "
                                   f"{key[1]} {key[0]}: remove one of them from the allow-list (--plugins)")
            owners[key] = plugin
    return owners


def _overridden_builtins(plugin_routes: dict[tuple[str, str], Any]) -> set[tuple[str, str]]:
    """The built-in routes the plugins replace; a clash without `override` is a StartupError naming it."""
    overridden = set()
    for key in routes.builtin_route_keys():
        plugin = plugin_routes.get(key)
        if plugin is None:
            continue
        rule, method = key
        if not getattr(plugin, "override", False):
            raise StartupError(
                f"endpoint plugin {plugin.name!r} adds the route {method} {rule}, which is a built-in route: "
                "choose another path, or set override = True on the plugin to replace the built-in one"
            )
        overridden.add(key)
    return overridden


# -- access (server/access.py), errors, the request log ---------------------------------------------


def _add_hooks(app: ApiApp, config: ServerConfig) -> None:
    @app.before_request
    async def identify_and_check_access() -> Any:
        g.started = time.perf_counter()
        answer = access.check_request(config)  # a CORS preflight's answer, or None
        if config.enable_log_requests and answer is None and request.method in access.JSON_METHODS:
            # Read (and kept) here: the route reads the body without keeping it. A body over the limit is
            # its 413 here, as it would be in the route.
            body: bytes = await request.get_data(cache=True, as_text=False, parse_form_data=False)
            g.logged_body = body.decode(errors="replace")[:config.max_log_len]
        return answer

    @app.after_request
    async def finish_and_log(response: Response) -> Response:
        access.finish_response(response, config)
        ignored = request_fields.header_value(getattr(g, "ignored_fields", None) or [])
        if ignored is not None:
            response.headers[request_fields.HEADER] = ignored
        if config.disable_log_requests:
            return response
        elapsed_ms = (time.perf_counter() - getattr(g, "started", time.perf_counter())) * 1000
        request_id = getattr(g, "request_id", "-")
        request_log.info("%s %s %s %s %.1f ms", request.method, request.path, response.status_code, request_id,
                         elapsed_ms)
        if getattr(g, "logged_body", None):
            request_log.info("%s body: %s", request_id, g.logged_body)
        return response

    @app.errorhandler(ApiError)
    async def api_error(error: ApiError) -> Response:
        return Response(error.body(), status=error.status, content_type="application/json", headers=error.headers)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        status = error.code or 500
        kinds = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}
        message = {413: f"the request body is larger than the limit of {config.max_request_body_bytes} bytes "
                        "(--max-request-body-bytes)"}.get(status, error.description or error.name)
        body = ApiError(status, message, type=kinds.get(status, "invalid_request_error"),
                        code="request_too_large" if status == 413 else None).body()
        return Response(body, status=status, content_type="application/json")

    @app.errorhandler(Exception)
    async def unexpected(error: Exception) -> Response:
        # A bug of ours or of a plugin's route. The client learns nothing of our internals (names,
        # paths, values), only the id under which the log has the traceback.
        request_id = getattr(g, "request_id", "-")
        logger.error("%s %s failed (request id %s)", request.method, request.path, request_id, exc_info=error)
        body = ApiError(500, f"internal error (request id {request_id})", type="internal_error",
                        code="internal_error").body()
        return Response(body, status=500, content_type="application/json")


# -- middleware ------------------------------------------------------------------------------------------


def _apply_middleware(app: ApiApp, paths: list[str]) -> None:
    from asyncengine.interfaces.imports import import_by_path

    for path in paths:
        try:
            middleware = import_by_path(path, what="--middleware", error=StartupError)
        except Exception as exc:  # an import error of the user's module, named with the option
            raise StartupError(f"--middleware {path!r} cannot be loaded: {exc}") from exc
        if isinstance(middleware, type):  # ASGI middleware: wraps the whole app
            # Replacing the asgi_app method is how Quart documents adding ASGI middleware.
            app.asgi_app = middleware(app.asgi_app)  # type: ignore[method-assign]
        elif inspect.iscoroutinefunction(middleware):
            app.http_middlewares.append(middleware)
        else:
            raise StartupError(f"--middleware {path!r} is {type(middleware).__name__}: give an ASGI middleware "
                               "class or an async function (request, call_next)")

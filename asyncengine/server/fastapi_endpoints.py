"""vLLM's endpoint plugins (`attach_router(app)` on a FastAPI app) served by our Quart server.

Each such plugin gets a FastAPI application of its own (no docs routes), on which its `attach_router`
adds its routes. The server then mounts that application: every path it declared becomes a Quart
rule (`{name}` -> `<name>`, `{name:path}` -> `<path:name>`, a Mount -> its prefix and everything
under it) whose handler passes the request, as ASGI, to the plugin's application, which routes it
itself. So a plugin route is behind everything a built-in route is behind: the API key, CORS, the
request id and log, `--middleware`, the clash check against built-in routes, the OpenAPI listing.
`init_state(engine_client, state, args)` runs once before the server takes requests, with the
application's `state` (what `raw_request.app.state` reads in a route) and the options as an
argparse.Namespace, as vLLM's server calls it. The application's lifespan then runs with the server's:
its startup (`@app.on_event("startup")` handlers, or a lifespan context the plugin set on
`app.router.lifespan_context`) after init_state and before the server takes requests, its shutdown
when the server stops; a mapping the lifespan yields is each request's `request.state`, as Starlette
gives it.

The plugin's application runs in a task of the response's scope (response_scope.py): its status line
and headers become the response's, its body chunks are streamed as they come, and it is cancelled
when the client leaves. WebSocket routes are refused at start-up (this server speaks HTTP only).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import re
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from quart import Response, request
from werkzeug.datastructures import Headers

from asyncengine.errors import StartupError
from asyncengine.interfaces.endpoint import EndpointPlugin, is_router_form, required_tasks_problem
from asyncengine.interfaces.registry import describe
from asyncengine.server.response_scope import current_response_scope

if TYPE_CHECKING:
    from asyncengine.frontend.engine_client import EngineClient

logger = logging.getLogger("asyncengine.server")

ALL_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
_PARAMETER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::([A-Za-z_]+))?\}")
# Starlette's path convertors, as werkzeug's.
_CONVERTERS = {None: "", "str": "", "path": "path:", "int": "int:", "float": "float:", "uuid": "uuid:"}
_MOUNTED_REST = "asyncengine_mounted_path"


def served_endpoint_plugins(plugins: list[Any], engine_client: EngineClient, server_config: Any) -> list[Any]:
    """The endpoint plugins as the app attaches them: ours as they are, vLLM's wrapped in RouterEndpoint.
    A plugin whose required_tasks the model (its runner resolved now) does not serve is a StartupError;
    a client that says what it serves (`served_tasks`: the render server's "render") is checked by that."""
    runner = getattr(getattr(engine_client, "model_config", None), "runner", None)
    tasks = getattr(engine_client, "served_tasks", None)
    for plugin in plugins:
        problem = required_tasks_problem(plugin, runner, tasks)
        if problem:
            raise StartupError(f"endpoint plugin {plugin.name!r} ({describe(type(plugin))}) {problem}")
    if not any(is_router_form(plugin) for plugin in plugins):
        return list(plugins)
    args = options_namespace(engine_client, server_config)
    return [RouterEndpoint(plugin, args) if is_router_form(plugin) else plugin for plugin in plugins]


def options_namespace(engine_client: EngineClient, server_config: Any) -> argparse.Namespace:
    """The engine's and the server's options in one Namespace: the `args` vLLM gives init_state."""
    values: dict[str, Any] = {}
    for config in (getattr(engine_client, "config", None), server_config):
        if isinstance(config, msgspec.Struct):
            values.update(msgspec.structs.asdict(config))
    return argparse.Namespace(**values)


class RouterEndpoint(EndpointPlugin):
    """One vLLM-form plugin, as an EndpointPlugin of ours: attach mounts its FastAPI app, serve runs
    its init_state."""

    def __init__(self, plugin: Any, args: argparse.Namespace) -> None:
        self.plugin = plugin
        self.name = plugin.name
        self.override = bool(getattr(plugin, "override", False))
        self.required_tasks = getattr(plugin, "required_tasks", None)
        self.args = args
        self.asgi_app: Any = None
        self.lifespan_state: dict[str, Any] | None = None  # what the app's lifespan yielded, when a mapping
        self._stop: anyio.Event | None = None  # set by the server's after_serving: run the lifespan's shutdown
        self._stopped: anyio.Event | None = None

    def attach(self, app: Any) -> None:
        fastapi = _import_fastapi(self.name)
        self.asgi_app = fastapi.FastAPI(title=f"endpoint plugin {self.name}", openapi_url=None, docs_url=None,
                                        redoc_url=None)
        self.plugin.attach_router(self.asgi_app)
        rules = _quart_rules(self.asgi_app, self.name)
        if not rules:
            raise StartupError(f"endpoint plugin {self.name!r}: attach_router(app) added no route")
        for index, (rule, methods) in enumerate(rules):
            app.add_url_rule(rule, f"endpoint_plugin.{self.name}.{index}", self._forward, methods=list(methods))
        app.after_serving(self._stop_lifespan)

    async def serve(self, engine_client: EngineClient, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        init_state = getattr(self.plugin, "init_state", None)
        if init_state is not None:
            try:
                result = init_state(engine_client, self.asgi_app.state, self.args)
                if inspect.isawaitable(result):
                    await result
            except Exception as exc:  # the plugin's own failure, named; the server does not start
                raise StartupError(f"endpoint plugin {self.name!r} failed in init_state(engine_client, state, "
                                   f"args): {type(exc).__name__}: {exc}") from exc
        # The app's lifespan, as Starlette runs it for an app it serves: startup now, shutdown when the
        # server stops (its after_serving sets _stop), both in this task: a lifespan that opens a task
        # group around its `yield` must leave it in the task that entered it. Waiting on _stop, not on
        # the server's task group's cancellation, which comes only after the shutdown grace period.
        self._stop, self._stopped = anyio.Event(), anyio.Event()
        try:
            async with self._lifespan() as state:
                self.lifespan_state = dict(state) if isinstance(state, Mapping) else None
                task_status.started()
                await self._stop.wait()  # then its shutdown runs, unless the grace period has run out
        finally:
            self._stopped.set()

    @asynccontextmanager
    async def _lifespan(self) -> AsyncIterator[Any]:
        # `async with` in the one task, never a manual __aexit__ (and no shield around it): a lifespan
        # may open a task group around its `yield`, whose scope only the task's own nesting can leave.
        entered = False
        try:
            async with self.asgi_app.router.lifespan_context(self.asgi_app) as state:
                entered = True
                yield state
        except Exception as exc:  # the plugin's startup or shutdown failed, named
            when = "shutdown" if entered else "startup"
            raise StartupError(f"endpoint plugin {self.name!r}: its FastAPI app's {when} (lifespan) raised "
                               f"{type(exc).__name__}: {exc}") from exc

    async def _stop_lifespan(self) -> None:
        """The server's after_serving: the app's shutdown runs, and the server waits for it."""
        if self._stop is not None and self._stopped is not None:
            self._stop.set()
            await self._stopped.wait()

    async def _forward(self, **_path_parameters: Any) -> Response:
        # The path parameters are the plugin app's to parse: it routes the request again, by its own rules.
        return await forward_to_asgi(self.asgi_app, self.name, self.lifespan_state)


def _import_fastapi(plugin_name: str) -> Any:
    try:  # an optional package, imported by name
        fastapi = importlib.import_module("fastapi")
    except ImportError as exc:
        raise StartupError(f"endpoint plugin {plugin_name!r} is vLLM's FastAPI form (attach_router): serving it "
                           f"needs the package 'fastapi', which cannot be imported here ({exc}): pip install "
                           "fastapi, or port it to attach(app) (docs/porting.md#endpoint-plugins)") from exc
    return fastapi


def quart_rule(path: str, plugin_name: str) -> str:
    """A Starlette path template as a werkzeug rule: `/items/{item_id:int}` -> `/items/<int:item_id>`."""

    def convert(match: re.Match[str]) -> str:
        name, convertor = match.group(1), match.group(2)
        if convertor not in _CONVERTERS:
            raise StartupError(f"endpoint plugin {plugin_name!r}: the path {path!r} uses the convertor "
                               f"{convertor!r}; served here: {', '.join(c for c in _CONVERTERS if c)}")
        return f"<{_CONVERTERS[convertor]}{name}>"

    return _PARAMETER.sub(convert, path)


def _quart_rules(asgi_app: Any, plugin_name: str) -> list[tuple[str, tuple[str, ...]]]:
    """(werkzeug rule, methods) for every route of the plugin's FastAPI app, in its order."""
    routing = importlib.import_module("starlette.routing")  # fastapi's own base, there with it
    Mount, Route, WebSocketRoute = routing.Mount, routing.Route, routing.WebSocketRoute

    rules: list[tuple[str, tuple[str, ...]]] = []
    for route in asgi_app.routes:
        if isinstance(route, WebSocketRoute):
            raise StartupError(f"endpoint plugin {plugin_name!r} adds the WebSocket route {route.path}: this "
                               "server serves HTTP routes only")
        if isinstance(route, Mount):
            prefix = quart_rule(route.path.rstrip("/"), plugin_name)
            rules.append((prefix or "/", ALL_METHODS))
            rules.append((f"{prefix}/<path:{_MOUNTED_REST}>", ALL_METHODS))
        elif isinstance(route, Route):
            methods = tuple(sorted(set(route.methods or ALL_METHODS) - {"HEAD"})) or ("GET",)
            rules.append((quart_rule(route.path, plugin_name), methods))
        else:
            raise StartupError(f"endpoint plugin {plugin_name!r} adds a route of type {type(route).__name__}, "
                               "which this server cannot mount: use app.get/post/..., an APIRouter or app.mount")
    return rules


async def forward_to_asgi(asgi_app: Any, plugin_name: str, lifespan_state: dict[str, Any] | None = None) -> Response:
    """This request, passed to `asgi_app` as ASGI; its answer as a streamed Quart response.
    `lifespan_state`: what the app's lifespan yielded, a copy of it in each request's scope (Starlette's)."""
    body = await request.get_data(as_text=False)
    scope = dict(request.scope)
    if lifespan_state is not None:
        scope["state"] = dict(lifespan_state)
    chunks_in, chunks_out = anyio.create_memory_object_stream[bytes](16)
    started, finished = anyio.Event(), anyio.Event()
    start: dict[str, Any] = {}
    failure: list[BaseException] = []
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await finished.wait()  # nothing more to read: the client is gone once the response has ended
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            start["status"] = message["status"]
            start["headers"] = [(bytes(k).decode("latin-1"), bytes(v).decode("latin-1"))
                                for k, v in message.get("headers", [])]
            started.set()
        elif message["type"] == "http.response.body":
            if message.get("body"):
                await chunks_in.send(bytes(message["body"]))
            if not message.get("more_body", False):
                chunks_in.close()
                finished.set()

    async def run() -> None:
        try:
            await asgi_app(scope, receive, send)
        except Exception as exc:  # the plugin route's failure: given to the handler, or logged named
            if "status" in start:  # Starlette answered 500 itself before re-raising: the client has it
                logger.error("endpoint plugin %r: %s %s raised after its response began", plugin_name,
                             scope.get("method"), scope.get("path"), exc_info=exc)
            else:
                failure.append(exc)
        finally:
            chunks_in.close()
            started.set()
            finished.set()

    current_response_scope().start_soon(run, name=f"endpoint plugin {plugin_name}")
    await started.wait()
    if "status" not in start:
        message = f"endpoint plugin {plugin_name!r}: its application answered {request.method} {request.path} " \
                  "with no response"
        if failure:
            raise RuntimeError(f"{message}: {type(failure[0]).__name__}: {failure[0]}") from failure[0]
        raise RuntimeError(message)

    async def stream() -> AsyncIterator[bytes]:
        async with chunks_out:
            async for chunk in chunks_out:
                yield chunk

    return Response(stream(), status=start["status"], headers=Headers(start["headers"]))

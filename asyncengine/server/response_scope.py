"""A response owns everything that serves it: ResponseScope.

One scope per HTTP request, open from the moment the route handler starts until the last byte of the
body is sent or the client is gone. The ASGI connection enters it (ResponseScopedConnection, the app's
`asgi_http_class`) in the task that runs the handler and then sends the body, so the scope outlives
the handler's `return` of a streaming body. A handler starts its helper tasks in the scope's task
group (`start_soon`: the producers of a multi-prompt stream) and hands it the request streams it
opened (`close_at_end`). However the response ends — the body ran to its end, the client left before
the status line, during the body or between two prompts, the handler raised — the scope then closes
those streams, which aborts their engine requests, and cancels its tasks. So a body that is never
iterated cannot leave a request running, and nothing that serves a response outlives it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any, Protocol

import anyio
import trio
from anyio.abc import TaskGroup
from hypercorn.typing import ASGISendCallable
from quart import Request
from quart_trio.asgi import TrioASGIHTTPConnection


class _Closable(Protocol):
    async def aclose(self) -> None: ...


_current: ContextVar["ResponseScope | None"] = ContextVar("asyncengine_response_scope", default=None)


class ResponseScope:
    def __init__(self, task_group: TaskGroup) -> None:
        self._task_group = task_group
        self._to_close: list[_Closable] = []

    def start_soon(self, function: Callable[..., Coroutine[Any, Any, Any]], *args: Any, name: str | None = None) -> None:
        """Run `function(*args)` for this response; it is cancelled when the response ends."""
        self._task_group.start_soon(function, *args, name=name)

    def close_at_end(self, stream: _Closable) -> None:
        """Close `stream` (an engine request's outputs, a channel) when the response ends, if nobody
        closed it before; closing twice is harmless."""
        self._to_close.append(stream)

    async def _end(self) -> None:
        with anyio.CancelScope(shield=True):  # also when the client's departure cancelled the response
            for stream in reversed(self._to_close):
                await stream.aclose()
        self._to_close.clear()
        self._task_group.cancel_scope.cancel()


@asynccontextmanager
async def response_scope() -> AsyncIterator[ResponseScope]:
    async with anyio.create_task_group() as task_group:
        scope = ResponseScope(task_group)
        token = _current.set(scope)
        try:
            yield scope
        finally:
            _current.reset(token)
            await scope._end()


def current_response_scope() -> ResponseScope:
    """The scope of the response being served (in a route handler of the app)."""
    scope = _current.get()
    if scope is None:
        raise RuntimeError("no response scope: the completion routes run in an ApiApp, whose asgi_http_class "
                           "(ResponseScopedConnection) opens one per request")
    return scope


class ResponseScopedConnection(TrioASGIHTTPConnection):
    """QuartTrio's HTTP connection, with the whole of handling a request (handler, then body) inside
    a ResponseScope. A client that leaves cancels this task, and with it the scope."""

    # QuartTrio's own override adds `nursery` to Quart's signature (and silences mypy's override error there too).
    async def handle_request(  # type: ignore[override]
        self, nursery: trio.Nursery, request: Request, send: ASGISendCallable
    ) -> None:
        async with response_scope():
            await super().handle_request(nursery, request, send)

"""The HTTP server under the app: Hypercorn's trio worker, with the per-connection task our own.

`serve_http` does what `hypercorn.trio.serve` does (the app's lifespan, the listening sockets, one
task per accepted connection, a graceful stop), except that each connection is served by
server/connection.py's `Connection`, which keeps whatever a protocol library raises in that one
connection (Hypercorn's own task lets it end the server), builds the HTTP/1.1 protocol with JSON error
replies (server/h11_errors.py) without replacing anything of Hypercorn's, and puts each request's app
call under the request-body deadline (server/body_deadline.py).

Stopping (`shutdown_trigger` returns): the listeners close, connections learn the server is stopping
(an idle one closes at once, HTTP/1.1 ones close after their response, HTTP/2 ones refuse new
streams), and the connections still open get `config.graceful_timeout` seconds before they are
cancelled; then the app's lifespan shuts down.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import AppWrapper, ASGIFramework, ConnectionState, LifespanState
from hypercorn.utils import repr_socket_addr

from asyncengine.server.body_deadline import BodyDeadline
from asyncengine.server.connection import Connection, Stream

Listener = trio.SocketListener | trio.SSLListener[trio.SocketStream]


async def serve_http(app: ASGIFramework, config: Config, *, request_body_timeout: float,
                     shutdown_trigger: Callable[[], Awaitable[None]],
                     task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` on `config.bind` until `shutdown_trigger` returns and the connections are done (or
    `config.graceful_timeout` has passed); `task_status` gets the bound addresses ("http://host:port")."""
    wrapped: AppWrapper = ASGIWrapper(app)
    lifespan_state: LifespanState = {}
    lifespan = Lifespan(wrapped, config, lifespan_state)
    context = WorkerContext(None)
    per_request = BodyDeadline(wrapped, request_body_timeout)

    async def serve_connection(stream: Stream) -> None:
        await Connection(stream, per_request, config, context, ConnectionState(lifespan_state.copy())).run()

    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as connections:
            listeners, binds = _listeners(config)
            async with trio.open_nursery() as accepting:
                accepting.start_soon(partial(trio.serve_listeners, serve_connection, listeners, handler_nursery=connections))
                task_status.started(binds)
                await shutdown_trigger()
                accepting.cancel_scope.cancel()  # closes the listeners
            await context.terminated.set()
            connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


def _listeners(config: Config) -> tuple[list[Listener], list[str]]:
    sockets = config.create_sockets()
    ssl_context = config.create_ssl_context()
    listeners: list[Listener] = []
    binds = []
    for sock in sockets.secure_sockets:
        if ssl_context is None:  # a secure socket is made only when there is a certificate
            raise ValueError(f"a TLS socket is bound without a TLS context: {config.bind}")
        sock.listen(config.backlog)
        listeners.append(trio.SSLListener(trio.SocketListener(trio.socket.from_stdlib_socket(sock)), ssl_context,
                                          https_compatible=True))
        binds.append(f"https://{repr_socket_addr(sock.family, sock.getsockname())}")
    for sock in sockets.insecure_sockets:
        sock.listen(config.backlog)
        listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
        binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
    return listeners, binds

"""The HTTP transport under the app: closing connections as HTTP says, and counting open responses.

Why `end_of_response_shielded`: Hypercorn (0.18) runs its end-of-response work inside the app's last
`send()` call, in the app's task: the response's last body message ends the stream, the stream
puts `http.disconnect` into the app's receive queue, and only then does Hypercorn close the
connection (`Connection: close`, HTTP/1.0) or start the keep-alive idle timer. Quart-Trio's ASGI
connection cancels its task group as soon as it receives `http.disconnect`; the cancellation lands in
that same `send()` call, at the checkpoint before the socket is closed, so the close and the idle timer
never happen: every connection stays established until the client closes it (an HTTP/1.0 stream, whose
end is the close, never ends). Shielding the one `send()` that ends the response lets Hypercorn finish
that work; what it does there is bounded (its socket writes are already shielded by Hypercorn itself).
A bare QuartTrio app shows the fault (docs/server.md, "Connections"); a plain ASGI app that returns
after sending does not.

The shield lasts as long as the connection (`ConnectionShields`): over HTTP/2 the end of a response
waits until the connection's sending task has taken the response's last bytes, and once the
connection is closed (the client left, a protocol error) that task is gone, so the wait would never
end, holding the connection's task, and its socket, forever. The server's connection task
(server/connection.py) cancels the shields of its requests when it ends. Under another server
(an embedder's) no connection sets them, and the shield is the plain one.

`ResponseCounter` counts the HTTP requests the app is serving, streams until their last byte, so the
server can let in-flight requests receive their error before it exits after the engine died.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import trio
from hypercorn.typing import ASGISendCallable, ASGISendEvent


class ConnectionShields:
    """The end-of-response shields of one connection's requests, cancelled together when it ends."""

    def __init__(self) -> None:
        self._open: set[trio.CancelScope] = set()
        self._ended = False

    @contextmanager
    def shield(self) -> Iterator[None]:
        with trio.CancelScope(shield=True) as scope:
            if self._ended:
                scope.cancel()
            self._open.add(scope)
            try:
                yield
            finally:
                self._open.discard(scope)

    def end(self) -> None:
        self._ended = True
        for scope in self._open:
            scope.cancel()


# Set by the server's connection task; its requests' tasks inherit it (trio copies the context of the
# task that starts them, the connection's).
connection_shields: ContextVar[ConnectionShields | None] = ContextVar("asyncengine_connection_shields",
                                                                      default=None)

def ends_the_response(message: Mapping[str, Any]) -> bool:
    return message.get("type") == "http.response.body" and not message.get("more_body", False)


def end_of_response_shielded(send: ASGISendCallable) -> ASGISendCallable:
    """`send`, with the message that ends an HTTP response sent under a shield (module docstring)."""

    async def shielded(message: ASGISendEvent) -> None:
        if not ends_the_response(message):
            await send(message)
            return
        shields = connection_shields.get()
        with shields.shield() if shields is not None else trio.CancelScope(shield=True):
            await send(message)

    return shielded


class ResponseCounter:
    """How many HTTP requests are being served now; `wait_idle` returns once there are none."""

    def __init__(self) -> None:
        self.open = 0
        self._changed = trio.Event()

    def started(self) -> None:
        self.open += 1

    def finished(self) -> None:
        self.open -= 1
        self._changed.set()
        self._changed = trio.Event()

    async def wait_idle(self) -> None:
        while self.open:
            await self._changed.wait()

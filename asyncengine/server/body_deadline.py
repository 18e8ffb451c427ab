"""The request-body timeout: a request whose body has not all arrived `--request-body-timeout` seconds
after its head is answered 408 and its connection closed.

A client that trickles its body (a byte a second) would otherwise hold its connection, its request
task and whatever it buffered for as long as it likes, whether it holds an API key or not: the key is
checked once the head is in, and a key holder's body is then read to its end. The clock starts when
the request's head has arrived (the moment Hypercorn starts the app for it) and stops when the app
has received the last of the body (or the client left). When it runs out, the app is cancelled, as
when a client leaves (its response scope aborts what it started), and:

- no response started yet: the client gets a 408 in OpenAI's error shape (code `request_timeout`);
  over HTTP/1.1 it says `Connection: close`, and the connection closes once it is sent (the rest of
  the body will never be read, so the connection cannot be reused);
- a response started already (an endpoint that answers while it reads): the response stops where
  it is; over HTTP/1.1 the connection closes.

Over HTTP/2 the 408 (or the cut response) ends that stream only; the connection closes once it has
been idle for `--keep-alive-timeout`, or as soon as the client sends more of that body (Hypercorn's
protocol raises on DATA for a finished stream, a fault the connection's task keeps to itself:
server/connection.py).

The head itself is bounded by the keep-alive idle timer, which runs until a request's head is whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from math import inf
from typing import Any

import trio
from hypercorn.typing import (
    AppWrapper,
    ASGIReceiveCallable,
    ASGIReceiveEvent,
    ASGISendCallable,
    ASGISendEvent,
    Scope,
)

from asyncengine.server.errors import ApiError

logger = logging.getLogger("asyncengine.server")

HTTP2_AND_LATER = frozenset({"2", "3"})  # connection-specific headers (Connection: close) are forbidden there


def body_timeout_error(timeout: float) -> ApiError:
    return ApiError(408, f"the request body did not all arrive within {timeout:g} s of its headers (the server's "
                         "--request-body-timeout): send it without pauses", code="request_timeout")


class BodyDeadline:
    """Hypercorn's app wrapper around another: each HTTP request's body must arrive within `timeout` s."""

    def __init__(self, app: AppWrapper, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable,
                       sync_spawn: Callable[..., Any], call_soon: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send, sync_spawn, call_soon)
            return
        response_started = False
        with trio.CancelScope(deadline=trio.current_time() + self.timeout) as body_deadline:

            async def receive_and_watch() -> ASGIReceiveEvent:
                message = await receive()
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    body_deadline.deadline = inf  # the whole body is in (or the client left)
                return message

            async def send_and_watch(message: ASGISendEvent) -> None:
                nonlocal response_started
                response_started = response_started or message["type"] == "http.response.start"
                await send(message)

            await self.app(scope, receive_and_watch, send_and_watch, sync_spawn, call_soon)
        if not body_deadline.cancelled_caught:
            return
        client = scope.get("client")
        logger.info("%s %s 408: its body did not arrive within %g s of its headers (client %s)",
                    scope["method"], scope["path"], self.timeout, f"{client[0]}:{client[1]}" if client else "-")
        if response_started:
            return  # cut where it is: HTTP/1.1 closes the connection, over HTTP/2 the idle timer does
        error = body_timeout_error(self.timeout)
        body = error.body()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if scope.get("http_version") not in HTTP2_AND_LATER:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": error.status, "headers": headers, "trailers": False})
        await send({"type": "http.response.body", "body": body, "more_body": False})

"""JSON bodies for the replies Hypercorn sends before the app runs: 400 (a malformed request head) and 431 (one too big).

Hypercorn's HTTP/1.1 protocol answers such a request itself, in `H11Protocol._send_error_response`,
with an empty body: the request never reaches the app, and Hypercorn has no hook for that reply. A
client of an OpenAI server expects every error as `{"error": {...}}`. The server builds each
connection's protocol itself (server/connection.py), so it builds this subclass of Hypercorn's, whose
error reply carries the body; nothing of Hypercorn's is replaced, and another Hypercorn server in the
same process (an embedder's) keeps Hypercorn's behaviour byte for byte.

The method is private: `h11_protocol_class()` checks it is there, with the signature it overrides,
and otherwise returns Hypercorn's own class and says so in the log (tests/server/test_http_hardening.py
fails then, so an upgrade that moves it is seen).
"""

from __future__ import annotations

import inspect
import logging
from functools import cache
from itertools import chain

import h11
from hypercorn.config import Config
from hypercorn.protocol.h11 import H11Protocol

from asyncengine.server.errors import ApiError

logger = logging.getLogger(__name__)


def error_for(status_code: int, config: Config) -> ApiError:
    """The OpenAI-shaped error for a status Hypercorn chose from h11's verdict on the request head."""
    if status_code == 431:
        return ApiError(431, f"the request line and headers are larger than the server accepts "
                             f"({config.h11_max_incomplete_size} bytes): send smaller headers",
                        code="request_header_fields_too_large")
    return ApiError(status_code, "the request could not be parsed as HTTP/1.1 (a malformed request line or "
                                 "header): check what the client sends", code="malformed_http_request")


class H11ProtocolWithErrorBodies(H11Protocol):
    async def _send_error_response(self, status_code: int) -> None:
        body = error_for(status_code, self.config).body()
        headers = chain(
            [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
             (b"connection", b"close")],
            self.config.response_headers("h11"),
        )
        await self._send_h11_event(h11.Response(status_code=status_code, headers=list(headers)))
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())


def _overridable() -> bool:
    method = getattr(H11Protocol, "_send_error_response", None)
    if method is None or not inspect.iscoroutinefunction(method):
        return False
    return list(inspect.signature(method).parameters) == ["self", "status_code"]


@cache
def h11_protocol_class() -> type[H11Protocol]:
    """The HTTP/1.1 protocol the server's connections use: with JSON error bodies where this Hypercorn allows."""
    if _overridable():
        return H11ProtocolWithErrorBodies
    logger.warning("this Hypercorn has no H11Protocol._send_error_response(status_code): its own 400 and 431 "
                   "replies keep an empty body")
    return H11Protocol

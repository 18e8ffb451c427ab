"""JSON bodies for the replies Hypercorn sends before the app runs: 400 (a malformed request head) and 431 (one too big).

Hypercorn answers such a request itself, in `H11Protocol._send_error_response`, with an empty body:
the request never reaches the app, and Hypercorn has no hook for that reply. A client of an OpenAI
server expects every error as `{"error": {...}}`, so the server replaces that one method.

Hypercorn's connection wrapper (`hypercorn.protocol.ProtocolWrapper`) builds its HTTP/1.1 protocol
by the module-level name `H11Protocol`, looked up each time a connection opens. `install()` points
that name at a subclass whose error reply carries a body only when the connection's Hypercorn
`Config` was made by asyncengine (it carries `ERROR_BODIES_ATTRIBUTE`): another Hypercorn server in
the same process (an embedder's) keeps Hypercorn's own behaviour byte for byte. The method is
private: `install()` checks it is there, with the signature it replaces, and otherwise leaves
Hypercorn alone and says so in the log (tests/server/test_http_hardening.py fails then, so an
upgrade that moves it is seen).
"""

from __future__ import annotations

import inspect
import logging
from itertools import chain

import h11
import hypercorn.protocol
from hypercorn.config import Config
from hypercorn.protocol.h11 import H11Protocol

from asyncengine.server.errors import ApiError

logger = logging.getLogger(__name__)

# Set (to True) on a Hypercorn Config by the server; connections served under another Config are untouched.
ERROR_BODIES_ATTRIBUTE = "asyncengine_error_bodies"


def error_for(status_code: int, config: Config) -> ApiError:
    """The OpenAI-shaped error for a status Hypercorn chose from h11's verdict on the request head."""
    if status_code == 431:
        return ApiError(431, f"the request line and headers are larger than the server accepts "
                             f"({config.h11_max_incomplete_size} bytes): send smaller headers",
                        code="request_header_fields_too_large")
    return ApiError(status_code, "the request could not be parsed as HTTP/1.1 (a malformed request line or "
                                 "header): check what the client sends", code="malformed_http_request")


class _H11ProtocolWithErrorBodies(H11Protocol):
    async def _send_error_response(self, status_code: int) -> None:
        if not getattr(self.config, ERROR_BODIES_ATTRIBUTE, False):
            await super()._send_error_response(status_code)
            return
        body = error_for(status_code, self.config).body()
        headers = chain(
            [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
             (b"connection", b"close")],
            self.config.response_headers("h11"),
        )
        await self._send_h11_event(h11.Response(status_code=status_code, headers=list(headers)))
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())


def _replaceable() -> bool:
    method = getattr(H11Protocol, "_send_error_response", None)
    if method is None or not inspect.iscoroutinefunction(method):
        return False
    return list(inspect.signature(method).parameters) == ["self", "status_code"]


def install(config: Config) -> bool:
    """Give the 400/431 replies Hypercorn makes for connections under `config` a JSON body; False if it cannot."""
    if not _replaceable():
        logger.warning("this Hypercorn has no H11Protocol._send_error_response(status_code): its own 400 and 431 "
                       "replies keep an empty body")
        return False
    setattr(config, ERROR_BODIES_ATTRIBUTE, True)
    current = hypercorn.protocol.H11Protocol
    if current is not _H11ProtocolWithErrorBodies:
        if current is not H11Protocol:
            logger.warning("hypercorn.protocol.H11Protocol was already replaced (by %r): its own 400 and 431 "
                           "replies keep their bodies", current)
            return False
        hypercorn.protocol.H11Protocol = _H11ProtocolWithErrorBodies  # type: ignore[misc]  # see module docstring
    return True

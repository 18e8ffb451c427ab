"""One HTTP connection: Hypercorn's protocol classes, driven by a task of ours that keeps their faults in it.

Hypercorn's trio worker serves each connection in a task (its `TCPServer`) that lets every exception
but OSError escape into the nursery holding all the connections, which ends the server: Hypercorn
0.18's HTTP/2 protocol raises KeyError when a DATA frame arrives on a stream whose response is already
sent (a 401, 413 or 415 answered before the body was read), and one such request over h2c took the
server and its engine down. So the server owns the per-connection work (server/http_server.py
accepts, `Connection` serves): whatever Hypercorn's protocols, h11, h2 or priority raise while serving
one connection ends that connection alone, logged as one warning line naming the peer, the protocol
and where it was raised (the traceback at debug level). A client that resets or leaves ends it
silently. The requests still running on it see their client leave: their response scopes abort
their engine requests (server/response_scope.py).

Otherwise a connection does what Hypercorn's does: the TLS handshake (ALPN picks HTTP/2 or
HTTP/1.1), HTTP/1.1 until the client switches to HTTP/2 (an h2c upgrade, or the prior-knowledge
preface), writes one at a time under a lock and shielded, and an idle timer that closes a
connection with no request in flight after `keep_alive_timeout` (at once when the server stops).
Its HTTP/1.1 protocol is server/h11_errors.py's, whose own 400 and 431 replies carry a JSON error.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Awaitable, Callable
from math import inf

import trio
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.protocol.h11 import H2CProtocolRequiredError, H2ProtocolAssumedError, H11Protocol
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.worker_context import TrioSingleTask, WorkerContext
from hypercorn.typing import AppWrapper, ConnectionState
from hypercorn.utils import parse_socket_addr, repr_socket_addr

from asyncengine.runtime.groups import leaves_of
from asyncengine.server.h11_errors import h11_protocol_class
from asyncengine.server.transport import ConnectionShields, connection_shields

logger = logging.getLogger("asyncengine.server")

MAX_RECEIVE = 2**16
# What a client that resets, closes or vanishes makes the socket raise: the end of its connection, not a fault.
CLIENT_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)

Stream = trio.SocketStream | trio.SSLStream[trio.SocketStream]


class Connection:
    """Serves one accepted stream until the client or the server closes it; `run` raises only Cancelled."""

    def __init__(self, stream: Stream, app: AppWrapper, config: Config, context: WorkerContext,
                 state: ConnectionState) -> None:
        self.stream = stream
        self.app = app
        self.config = config
        self.context = context
        self.state = state
        self.peer = "an unknown peer"
        self.protocol: _Protocol | None = None
        self._send_lock = trio.Lock()
        self._idle = TrioSingleTask()
        self._task_group: TaskGroup | None = None

    async def run(self) -> None:
        try:
            await self._serve()
        except* CLIENT_GONE:
            pass
        except* Exception as group:  # a protocol library's fault on this connection: it ends here (module docstring)
            self._log_fault(group)
        finally:
            await self._close()

    async def _serve(self) -> None:
        alpn_protocol = await self._handshake()
        if alpn_protocol is None:
            return
        sock = self.stream.transport_stream.socket if isinstance(self.stream, trio.SSLStream) else self.stream.socket
        self.peer = repr_socket_addr(sock.family, sock.getpeername())
        client, server = parse_socket_addr(sock.family, sock.getpeername()), parse_socket_addr(sock.family,
                                                                                              sock.getsockname())
        shields = ConnectionShields()
        connection_shields.set(shields)  # the requests' tasks, started from this one, see it
        async with TaskGroup() as task_group:
            self._task_group = task_group
            try:
                self.protocol = protocol = _Protocol(
                    (self.app, self.config, self.context, task_group, self.state,
                     isinstance(self.stream, trio.SSLStream), client, server, self._protocol_send), alpn_protocol)
                await protocol.initiate()
                await self._idle.restart(task_group, self._idle_timeout)
                await self._read(protocol)
                # The client closed (or the protocol closed the connection): nothing is left for the idle
                # timer to close, and the task group would wait for it (Hypercorn's own task does, up to
                # keep_alive_timeout after the client has gone).
                await self._idle.stop()
            finally:
                # Nothing more can be sent: a response still in its shielded end (server/transport.py)
                # would wait for a sender that is gone.
                shields.end()

    async def _handshake(self) -> str | None:
        """The protocol TLS's ALPN chose ("http/1.1" without TLS); None when the handshake failed."""
        if not isinstance(self.stream, trio.SSLStream):
            return "http/1.1"
        try:
            with trio.fail_after(self.config.ssl_handshake_timeout):
                await self.stream.do_handshake()
        except (trio.BrokenResourceError, trio.TooSlowError):
            return None
        return self.stream.selected_alpn_protocol() or "http/1.1"

    async def _read(self, protocol: _Protocol) -> None:
        while True:
            try:
                with trio.fail_after(self.config.read_timeout or inf):
                    data = await self.stream.receive_some(MAX_RECEIVE)
            except (trio.ClosedResourceError, trio.BrokenResourceError, trio.TooSlowError):
                break
            await protocol.handle(RawData(bytes(data)))
            if not data:
                break
        await protocol.handle(Closed())

    async def _protocol_send(self, event: Event) -> None:
        """What the protocol asks of the transport: bytes to write, a close, idle or busy."""
        if isinstance(event, RawData):
            async with self._send_lock:
                try:
                    with trio.CancelScope(shield=True):  # a response's bytes go out whole or not at all
                        await self.stream.send_all(event.data)
                # Busy: `_close` is sending the EOF (it takes no lock, so that a send blocked on a client
                # that does not read cannot hold the close).
                except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
                    await self._protocol_closed()
        elif isinstance(event, Closed):
            await self._close()
            await self._protocol_closed()
        elif isinstance(event, Updated) and self._task_group is not None:
            if event.idle:
                await self._idle.restart(self._task_group, self._idle_timeout)
            else:
                await self._idle.stop()

    async def _protocol_closed(self) -> None:
        if self.protocol is not None:
            await self.protocol.handle(Closed())

    async def _idle_timeout(self) -> None:
        with trio.move_on_after(self.config.keep_alive_timeout):
            await self.context.terminated.wait()  # a stopping server closes idle connections at once
        with trio.CancelScope(shield=True):
            await self._protocol_closed()
            await self.stream.aclose()

    async def _close(self) -> None:
        try:
            await self.stream.send_eof()
        except (trio.BrokenResourceError, trio.BusyResourceError, trio.ClosedResourceError, AttributeError):
            pass  # gone already, or TLS (no half-close)
        await self.stream.aclose()

    def _log_fault(self, group: BaseExceptionGroup) -> None:
        faults = leaves_of(group)
        protocol = self.protocol.name if self.protocol is not None else "before the protocol started"
        logger.warning("connection from %s (%s) closed: %s; the server goes on", self.peer, protocol,
                       "; ".join(_where(fault) for fault in faults))
        for fault in faults:
            logger.debug("connection from %s: the fault's traceback", self.peer, exc_info=fault)


def _where(fault: BaseException) -> str:
    """`KeyError: 1, raised at hypercorn/protocol/h2.py:259 in _handle_events`: what, and the culprit."""
    frames = traceback.extract_tb(fault.__traceback__)
    what = "".join(traceback.format_exception_only(fault)).strip()
    if not frames:
        return what
    frame = frames[-1]
    parts = frame.filename.split(os.sep)
    shown = os.sep.join(parts[parts.index("site-packages") + 1:]) if "site-packages" in parts else frame.filename
    return f"{what}, raised at {shown}:{frame.lineno} in {frame.name}"


class _Protocol:
    """HTTP/1.1 (ours, with JSON error bodies) until the client switches to HTTP/2 (an h2c upgrade, or
    the prior-knowledge preface), or HTTP/2 from the start when TLS's ALPN chose it."""

    def __init__(self, arguments: tuple[AppWrapper, Config, WorkerContext, TaskGroup, ConnectionState, bool,
                                        tuple[str, int] | None, tuple[str, int] | None,
                                        Callable[[Event], Awaitable[None]]], alpn_protocol: str) -> None:
        self._arguments = arguments  # what both protocol classes take
        self.current: H11Protocol | H2Protocol = (
            H2Protocol(*arguments) if alpn_protocol == "h2" else h11_protocol_class()(*arguments))

    @property
    def name(self) -> str:
        return "HTTP/2" if isinstance(self.current, H2Protocol) else "HTTP/1.1"

    async def initiate(self) -> None:
        await self.current.initiate()

    async def handle(self, event: Event) -> None:
        try:
            await self.current.handle(event)
            return
        except H2ProtocolAssumedError as switch:  # "PRI * HTTP/2.0": HTTP/2 with prior knowledge
            self.current = h2 = H2Protocol(*self._arguments)
            await h2.initiate()
            data = switch.data
        except H2CProtocolRequiredError as switch:  # "Upgrade: h2c", answered 101 already
            self.current = h2 = H2Protocol(*self._arguments)
            await h2.initiate(switch.headers, switch.settings)
            data = switch.data
        if data:
            await h2.handle(RawData(data=data))

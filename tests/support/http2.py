"""An HTTP/2 cleartext client over a real socket, with the `h2` library: prior knowledge or an h2c upgrade.

`open_h2c` gives a connected socket and the client's H2Connection; `h2c_request` sends one request and
returns its status, headers and body; `send_then_data_after_the_answer` is the sequence that killed the
server through Hypercorn's HTTP/2 protocol (issue 30, item 1): a request the server answers before
reading its body (a 415, a 401, a 413, a POST to /health), then a DATA frame for it once the answer
is in.
"""

from __future__ import annotations

import socket

import h2.config
import h2.connection
import h2.events

PRIOR_KNOWLEDGE, UPGRADE = "prior knowledge", "h2c upgrade"


def client_connection() -> h2.connection.H2Connection:
    return h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))


def upgrade_head(settings: bytes, path: str = "/health") -> bytes:
    """An HTTP/1.1 request (no body) asking to switch to h2c; the server answers it as HTTP/2 stream 1."""
    return (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
            f"HTTP2-Settings: {settings.decode()}\r\n\r\n").encode()


def read_http1_head(sock: socket.socket) -> tuple[bytes, bytes]:
    """The HTTP/1.1 response head (a 101 for an upgrade), and the bytes that came after it."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"the server closed the connection during the HTTP/1.1 head: {received!r}")
        received += chunk
    head, _, rest = received.partition(b"\r\n\r\n")
    return head, rest


def open_h2c(port: int, mode: str, timeout: float = 60) -> tuple[socket.socket, h2.connection.H2Connection]:
    """A socket speaking HTTP/2 to the server, `mode` PRIOR_KNOWLEDGE or UPGRADE (stream 1 is then the
    upgrade's own GET /health, answered as HTTP/2)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    connection = client_connection()
    if mode == UPGRADE:
        sock.sendall(upgrade_head(connection.initiate_upgrade_connection()))
        head, rest = read_http1_head(sock)
        assert head.startswith(b"HTTP/1.1 101"), head
        if rest:
            connection.receive_data(rest)
    else:
        connection.initiate_connection()
    sock.sendall(connection.data_to_send())
    return sock, connection


def request_headers(method: str, path: str, headers: dict[str, str] | None = None) -> list[tuple[bytes, bytes]]:
    return [(b":method", method.encode()), (b":path", path.encode()), (b":scheme", b"http"),
            (b":authority", b"127.0.0.1"), *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items())]


def read_stream(sock: socket.socket, connection: h2.connection.H2Connection,
                stream_id: int) -> tuple[int, dict[bytes, bytes], bytes]:
    """Read until `stream_id` ends: its status, headers and body (AssertionError if the connection ends first)."""
    status, headers, body = 0, {}, b""
    while True:
        data = sock.recv(65536)
        if not data:
            raise AssertionError(f"the server closed the connection before stream {stream_id} ended "
                                 f"(status {status}, body {body[:200]!r})")
        for event in connection.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived) and event.stream_id == stream_id:
                headers = dict(event.headers)
                status = int(headers[b":status"])
            elif isinstance(event, h2.events.DataReceived):
                connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                if event.stream_id == stream_id:
                    body += event.data
            elif isinstance(event, h2.events.StreamEnded) and event.stream_id == stream_id:
                sock.sendall(connection.data_to_send())
                return status, headers, body
            elif isinstance(event, (h2.events.StreamReset, h2.events.ConnectionTerminated)):
                raise AssertionError(f"stream {stream_id}: {event}")
        sock.sendall(connection.data_to_send())


def h2c_request(port: int, mode: str, method: str, path: str, headers: dict[str, str] | None = None,
                body: bytes = b"") -> tuple[int, dict[bytes, bytes], bytes]:
    """One request over a fresh h2c connection: status, headers, body."""
    sock, connection = open_h2c(port, mode)
    with sock:
        stream_id = connection.get_next_available_stream_id()
        connection.send_headers(stream_id, request_headers(method, path, headers), end_stream=not body)
        size = connection.max_outbound_frame_size
        for start in range(0, len(body), size):
            connection.send_data(stream_id, body[start:start + size], end_stream=start + size >= len(body))
        sock.sendall(connection.data_to_send())
        return read_stream(sock, connection, stream_id)


def send_then_data_after_the_answer(port: int, mode: str, method: str, path: str, headers: dict[str, str],
                                    data: bytes) -> int:
    """Send a request's headers, wait for its answer (sent before the body is read), then send `data` on
    its stream: the status the server answered. The server then may close the connection."""
    sock, connection = open_h2c(port, mode)
    with sock:
        stream_id = connection.get_next_available_stream_id()
        connection.send_headers(stream_id, request_headers(method, path, headers))
        sock.sendall(connection.data_to_send())
        status, _, _ = read_stream(sock, connection, stream_id)
        # The stream is half-closed on the client's side only: h2 lets the client send on it.
        size = connection.max_outbound_frame_size
        for start in range(0, len(data), size):
            connection.send_data(stream_id, data[start:start + size])
        try:
            sock.sendall(connection.data_to_send())
            sock.recv(65536)  # whatever comes back (or the close)
        except OSError:  # the server closed the connection: allowed
            pass
        return status

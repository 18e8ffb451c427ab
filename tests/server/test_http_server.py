"""The server's own accept loop and connection tasks (server/http_server.py, server/connection.py), in this
process, over TLS (the real servers of the other modules serve cleartext): ALPN chooses HTTP/2 or
HTTP/1.1, a fault of Hypercorn's HTTP/2 protocol on one TLS connection ends that connection alone (logged
with the peer), the next connections are served, and the server stops when told."""

from __future__ import annotations

import http.client
import json
import logging
import shutil
import socket
import ssl
import subprocess
from functools import partial

import pytest
import trio
from hypercorn.config import Config

from asyncengine.server.http_server import serve_http
from support.http2 import client_connection, read_stream, request_headers


async def echo_app(scope, receive, send) -> None:
    """/early answers 415 before reading the body (as the API does for a wrong content type); any other
    path answers what it was sent."""
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/early":
        await send({"type": "http.response.start", "status": 415, "headers": []})
        await send({"type": "http.response.body", "body": b"not that"})
        return
    body, more = b"", True
    while more:
        message = await receive()
        body, more = body + message.get("body", b""), message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % (len(body) + 5))]})
    await send({"type": "http.response.body", "body": b"echo:" + body})


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a self-signed certificate")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost"],
                   check=True, capture_output=True)
    return str(cert), str(key)


def tls_socket(port: int, alpn: str) -> ssl.SSLSocket:
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols([alpn])
    sock = context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10))
    assert sock.selected_alpn_protocol() == alpn
    return sock


def clients(port: int) -> None:
    # HTTP/2 over TLS: the early 415, then DATA on its stream. Hypercorn 0.18 raises KeyError there.
    with tls_socket(port, "h2") as sock:
        connection = client_connection()
        connection.initiate_connection()
        connection.send_headers(1, request_headers("POST", "/early"))
        sock.sendall(connection.data_to_send())
        assert read_stream(sock, connection, 1)[0] == 415
        connection.send_data(1, b"0123456789")
        sock.sendall(connection.data_to_send())
        try:
            while sock.recv(65536):  # until the server closes this connection
                pass
        except OSError:
            pass
    # The server goes on: HTTP/2 and HTTP/1.1 over TLS.
    with tls_socket(port, "h2") as sock:
        connection = client_connection()
        connection.initiate_connection()
        connection.send_headers(1, request_headers("POST", "/echo"))
        connection.send_data(1, b"hello", end_stream=True)
        sock.sendall(connection.data_to_send())
        assert read_stream(sock, connection, 1)[0::2] == (200, b"echo:hello")
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    https = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    https.request("POST", "/echo", body=json.dumps({"a": 1}))
    response = https.getresponse()
    assert (response.status, response.read()) == (200, b'echo:{"a": 1}')
    https.close()


def test_a_protocol_fault_over_tls_ends_only_its_connection(certificate, caplog):
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.certfile, config.keyfile = certificate

    async def main() -> None:
        stop = trio.Event()
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                binds = await nursery.start(partial(serve_http, echo_app, config, request_body_timeout=10,
                                                    shutdown_trigger=stop.wait))
                assert binds[0].startswith("https://127.0.0.1:")
                await trio.to_thread.run_sync(clients, int(binds[0].rsplit(":", 1)[1]))
                stop.set()  # and serve_http returns

    with caplog.at_level(logging.WARNING, logger="asyncengine.server"):
        trio.run(main)
    (fault,) = [record.getMessage() for record in caplog.records if "closed:" in record.getMessage()]
    assert fault.startswith("connection from 127.0.0.1:") and "(HTTP/2) closed: KeyError" in fault, fault

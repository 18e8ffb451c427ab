"""A parent listens, its children connect back and say who they are: the hand-shake.

Unix sockets live in a private directory (mode 0700) made per launch; over TCP (for children on
other hosts) the same hand-shake carries a random per-launch secret, which the parent checks before
it says anything. A child that presents the wrong secret is dropped.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, cast

import anyio
from anyio.abc import SocketListener, SocketStream

from asyncengine.errors import StartupError
from asyncengine.wire.framing import FrameStream
from asyncengine.wire.messages import Hello


@dataclass
class Listener:
    """Where children connect. `address` is `unix:/path` or `tcp:host:port`."""

    address: str
    secret: str
    listener: SocketListener
    directory: str | None = None

    async def aclose(self) -> None:
        await self.listener.aclose()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


async def open_listener(transport: str = "unix", host: str = "127.0.0.1") -> Listener:
    secret = secrets.token_hex(16)
    if transport == "unix":
        directory = tempfile.mkdtemp(prefix="asyncengine-")  # created 0700: only this user
        path = os.path.join(directory, "engine.sock")
        listener = await anyio.create_unix_listener(path, mode=0o600)
        return Listener(f"unix:{path}", secret, listener, directory)
    if transport == "tcp":
        # One address, hence one socket: its listener (the wrapper has no accept()).
        # (MultiListener types its parts as plain Listeners; for TCP each is a SocketListener.)
        tcp_listeners = await anyio.create_tcp_listener(local_host=host, local_port=0)
        tcp_listener = cast(SocketListener, tcp_listeners.listeners[0])
        port = tcp_listener.extra(anyio.abc.SocketAttribute.local_port)
        return Listener(f"tcp:{host}:{port}", secret, tcp_listener)
    raise ValueError(f"unknown transport {transport!r} (unix or tcp)")


async def accept_child(listener: Listener, inbox_type: Any, *, role: str, timeout: float) -> tuple[FrameStream, Hello]:
    """The next child that connects with the right secret and says Hello."""
    with anyio.fail_after(timeout):
        while True:
            stream = await listener.listener.accept()
            frames = FrameStream(stream, inbox_type, peer=f"a connecting {role}")
            try:
                hello = await frames.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                await frames.aclose()
                continue
            if not isinstance(hello, Hello) or not secrets.compare_digest(hello.secret, listener.secret):
                await frames.aclose()  # not ours: someone else knocking on the port
                continue
            frames.peer = f"{hello.role} (pid {hello.pid})" if hello.role != "worker" else f"worker rank {hello.rank} (pid {hello.pid})"
            return frames, hello


async def connect_to_parent(address: str, secret: str, inbox_type: Any, *, role: str, rank: int) -> FrameStream:
    kind, _, where = address.partition(":")
    stream: SocketStream
    if kind == "unix":
        stream = await anyio.connect_unix(where)
    elif kind == "tcp":
        host, _, port = where.rpartition(":")
        stream = await anyio.connect_tcp(host, int(port))
    else:
        raise StartupError(f"bad parent address {address!r}")
    frames = FrameStream(stream, inbox_type, peer="parent")
    await frames.send(Hello(secret=secret, role=role, rank=rank, pid=os.getpid()))
    return frames

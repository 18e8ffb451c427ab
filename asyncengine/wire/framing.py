"""Length-prefixed msgpack frames over an anyio byte stream.

Each frame is a 4-byte big-endian length, then a msgpack-encoded msgspec Struct. Receiving decodes
straight into the expected message types (a tagged union), so a malformed or unexpected frame is a
`ProtocolError` naming the peer, never a half-understood dict. Nothing is pickled.
"""

from __future__ import annotations

import struct
from typing import Any

import anyio
import msgspec
from anyio.abc import ByteStream
from anyio.streams.buffered import BufferedByteReceiveStream

_HEADER = struct.Struct("!I")
MAX_FRAME_BYTES = 1 << 30


class ProtocolError(Exception):
    """A peer sent something that is not a valid frame of the expected messages."""


class FrameStream:
    """Send and receive msgspec Structs as frames over `stream`; `peer` names the other side in errors."""

    def __init__(self, stream: ByteStream, message_type: Any, *, peer: str) -> None:
        self._stream = stream
        self._reader = BufferedByteReceiveStream(stream)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(message_type)
        self._send_lock = anyio.Lock()
        self.peer = peer

    async def send(self, message: msgspec.Struct) -> None:
        payload = self._encoder.encode(message)
        async with self._send_lock:  # frames from concurrent senders must not interleave
            await self._stream.send(_HEADER.pack(len(payload)) + payload)

    async def receive(self) -> Any:
        """The next message; raises anyio.EndOfStream when the peer closed the connection cleanly."""
        try:
            header = await self._reader.receive_exactly(_HEADER.size)
        except anyio.IncompleteRead as exc:
            raise anyio.EndOfStream from exc
        (length,) = _HEADER.unpack(header)
        if length > MAX_FRAME_BYTES:
            raise ProtocolError(f"{self.peer} sent a frame of {length} bytes (limit {MAX_FRAME_BYTES})")
        try:
            payload = await self._reader.receive_exactly(length)
        except anyio.IncompleteRead as exc:
            raise ProtocolError(f"{self.peer} closed the connection in the middle of a frame") from exc
        try:
            return self._decoder.decode(payload)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"{self.peer} sent an invalid message: {exc}") from exc

    async def aclose(self) -> None:
        await self._stream.aclose()

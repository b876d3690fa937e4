"""Length-prefixed msgpack frames over a local stream socket: the engine core's output channel.

Each frame is a 4-byte little-endian length and one `core_messages.CoreOutput` message. Unlike a
ZMQ socket neither end has a background I/O thread, so a step's outputs wake one thread of the API
process and none of the core's (`EngineCoreClient.read_on_loop`).
"""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

logger = logging.getLogger(__name__)

T = TypeVar("T")
_HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = (1 << 32) - 1
_SMALL_FRAME_BYTES = 1 << 16  # below this the header and payload go out in one write


class FrameSender:
    """Writes frames to a connected stream socket; a full socket buffer blocks until the reader
    catches up."""

    def __init__(self, sock: socket.socket, encoder: msgspec.msgpack.Encoder | None = None) -> None:
        self.sock = sock
        self._encoder = encoder or msgspec.msgpack.Encoder()
        self._buffer = bytearray(_HEADER.size)  # reused by `send_message`: header, then the message

    def send(self, payload: bytes) -> None:
        """Write one frame (`OSError` when the peer is gone, `ValueError` over 4 GiB)."""
        size = _checked_size(len(payload))
        if size < _SMALL_FRAME_BYTES:
            self.sock.sendall(_HEADER.pack(size) + payload)
        else:  # no copy of a large payload (the start-up message carries the tokenizer)
            self.sock.sendall(_HEADER.pack(size))
            self.sock.sendall(payload)

    def send_message(self, message: Any) -> None:
        """Encode a msgspec message and write it as one frame (errors as for `send`; a value
        msgspec cannot encode is a `TypeError`, and nothing is written then)."""
        buffer = self._buffer
        self._encoder.encode_into(message, buffer, _HEADER.size)
        _HEADER.pack_into(buffer, 0, _checked_size(len(buffer) - _HEADER.size))
        self.sock.sendall(buffer)
        if len(buffer) > _SMALL_FRAME_BYTES:  # do not keep a large start-up message's buffer
            self._buffer = bytearray(_HEADER.size)

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()


class FrameReceiver:
    """Reads whole frames from a connected stream socket, keeping a partial one for later."""

    def __init__(self, sock: socket.socket, read_bytes: int = 1 << 20,
                 decoder: msgspec.msgpack.Decoder[Any] | None = None) -> None:
        self.sock = sock
        self.decoder = decoder
        self._pending = bytearray()
        # One buffer for every read: `recv(n)` would allocate (mmap and munmap) n bytes per call.
        self._buffer = bytearray(read_bytes)
        self._view = memoryview(self._buffer)
        self._timeout: float | None = sock.gettimeout()

    def fileno(self) -> int:
        """The socket's file descriptor (for an event loop's `add_reader`)."""
        return self.sock.fileno()

    def receive(self, timeout: float | None) -> list[bytes] | None:
        """The frames completed by one read, after waiting up to `timeout` seconds for data (0:
        not at all; None: without limit). [] when nothing complete arrived; None once the peer
        has closed its end and every frame it sent was returned."""
        return self._receive(timeout, bytes)

    def receive_messages(self, timeout: float | None) -> list[Any] | None:
        """As `receive`, but each frame decoded by the typed decoder given at construction; a
        frame that does not decode is logged and skipped (the stream stays in step)."""
        decoder = self.decoder
        if decoder is None:
            raise ValueError("receive_messages needs the FrameReceiver built with a decoder")

        def decode(frame: memoryview) -> Any:
            try:
                return decoder.decode(frame)
            except msgspec.DecodeError:
                logger.exception("frame receiver: a frame of %d bytes does not decode; skipped", len(frame))
                return None

        return self._receive(timeout, decode)

    def _receive(self, timeout: float | None, convert: Callable[[memoryview], T]) -> list[T] | None:
        if timeout != self._timeout:
            self.sock.settimeout(timeout)
            self._timeout = timeout
        try:
            size = self.sock.recv_into(self._buffer)
        except (TimeoutError, BlockingIOError):
            return []
        if not size:
            return None
        self._pending += self._view[:size]
        return [item for item in self._split(convert) if item is not None]

    def _split(self, convert: Callable[[memoryview], T]) -> list[T]:
        items: list[T] = []
        pending, offset, end = self._pending, 0, len(self._pending)
        with memoryview(pending) as view:  # released before `pending` is resized below
            while end - offset >= _HEADER.size:
                (size,) = _HEADER.unpack_from(pending, offset)
                start = offset + _HEADER.size
                if end - start < size:
                    break
                with view[start:start + size] as frame:
                    items.append(convert(frame))
                offset = start + size
        del pending[:offset]
        return items

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()


def _checked_size(size: int) -> int:
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {size} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    return size

"""Length-prefixed frames over a local stream socket: the engine core's output channel.

Each frame is a 4-byte little-endian length and that many bytes (one msgpack message). The core
writes a step's outputs with one `sendall` from its own loop; the API process reads them on its
event loop (or, until that loop runs, on a reader thread). Unlike a ZMQ socket, neither end has a
background I/O thread, so a step's outputs wake one thread of the API process and none of the
core's (see `EngineCoreClient.read_on_loop`).
"""

from __future__ import annotations

import socket
import struct

_HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = (1 << 32) - 1
_SMALL_FRAME_BYTES = 1 << 16  # below this the header and payload go out in one write


class FrameSender:
    """Writes frames to a connected stream socket; a full socket buffer blocks until the reader
    catches up."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, payload: bytes) -> None:
        """Write one frame (`OSError` when the peer is gone, `ValueError` over 4 GiB)."""
        size = len(payload)
        if size > MAX_FRAME_BYTES:
            raise ValueError(f"a frame of {size} bytes is over the {MAX_FRAME_BYTES}-byte limit")
        if size < _SMALL_FRAME_BYTES:
            self.sock.sendall(_HEADER.pack(size) + payload)
        else:  # no copy of a large payload (the start-up message carries the tokenizer)
            self.sock.sendall(_HEADER.pack(size))
            self.sock.sendall(payload)

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()


class FrameReceiver:
    """Reads whole frames from a connected stream socket, keeping a partial one for later."""

    def __init__(self, sock: socket.socket, read_bytes: int = 1 << 20) -> None:
        self.sock = sock
        self._pending = bytearray()
        # One buffer for every read: `recv(n)` allocates n bytes per call, and at 1 MiB that
        # allocation (an mmap and munmap each time) cost more than the read itself.
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
        return self._split()

    def _split(self) -> list[bytes]:
        frames, pending, offset, end = [], self._pending, 0, len(self._pending)
        while end - offset >= _HEADER.size:
            (size,) = _HEADER.unpack_from(pending, offset)
            start = offset + _HEADER.size
            if end - start < size:
                break
            frames.append(bytes(pending[start:start + size]))
            offset = start + size
        del pending[:offset]
        return frames

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()

"""Length-prefixed msgpack frames (a 4-byte little-endian length, one `core_messages` message) on
the one Unix stream socket between the API process and the engine core, both ways. Writes block;
reads never do (a poll, then `MSG_DONTWAIT`), so one thread can read while another writes."""

from __future__ import annotations

import collections
import logging
import select
import socket
import struct
import threading
from typing import Any

import msgspec

from hybridserve.errors import EngineDeadError, EngineOverloadedError

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = (1 << 32) - 1


def encode_frame(encoder: msgspec.msgpack.Encoder, message: Any) -> bytearray:
    """One whole frame for `message` (msgspec's `TypeError`/`OverflowError` for a value it cannot
    encode, `ValueError` over 4 GiB)."""
    frame = bytearray(_HEADER.size)
    encoder.encode_into(message, frame, _HEADER.size)
    _HEADER.pack_into(frame, 0, _checked_size(len(frame) - _HEADER.size))
    return frame


class FrameSender:
    """Writes messages as frames from the calling thread; a full socket blocks until the peer reads."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._encoder = msgspec.msgpack.Encoder()

    def send_message(self, message: Any) -> None:
        """Write one message as a frame (`OSError` when the peer is gone; nothing is written when
        it cannot be encoded)."""
        self.sock.sendall(encode_frame(self._encoder, message))


class FrameOutbox:
    """Frames queued for a socket and written by one sender thread, so that no caller blocks on a
    full socket. `put` refuses new frames with `EngineOverloadedError` while `max_bytes` or more
    wait (the frame being written included), unless forced (aborts, shutdown)."""

    def __init__(self, sock: socket.socket, max_bytes: int) -> None:
        self.sock = sock
        self.max_bytes = max_bytes
        self.queued_bytes = 0
        self.closed = False
        self._frames: collections.deque[bytearray] = collections.deque()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="hybridserve-frame-sender", daemon=True)
        self._thread.start()

    def put(self, frame: bytearray, force: bool = False) -> None:
        """Queue one encoded frame (`encode_frame`) for the sender thread."""
        with self._cond:
            if self.closed:
                raise EngineDeadError("the connection to the engine core is closed")
            if not force and self.queued_bytes >= self.max_bytes:
                raise EngineOverloadedError(f"the engine core's input queue holds {self.queued_bytes} bytes "
                                            f"(limit {self.max_bytes}); retry later")
            self._frames.append(frame)
            self.queued_bytes += len(frame)
            self._cond.notify()

    def close(self) -> None:
        """Stop the sender thread; frames not yet written are dropped."""
        with self._cond:
            self.closed = True
            self._frames.clear()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._frames and not self.closed:
                    self._cond.wait()
                if self.closed:
                    return
                frames = list(self._frames)
                self._frames.clear()
            size = sum(len(frame) for frame in frames)
            try:
                self.sock.sendall(frames[0] if len(frames) == 1 else b"".join(frames))
            except OSError:  # the core is gone: the reader sees the end of the stream
                self.close()
                return
            with self._cond:
                self.queued_bytes -= size


class FrameReceiver:
    """Reads whole frames from a connected stream socket and decodes them, keeping a partial
    frame for later; it never blocks beyond the timeout it is given."""

    def __init__(self, sock: socket.socket, decoder: msgspec.msgpack.Decoder[Any], read_bytes: int = 1 << 20) -> None:
        self.sock = sock
        self.decoder = decoder
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._pending = bytearray()
        # One buffer for every read: `recv(n)` would allocate (mmap and munmap) n bytes per call.
        self._buffer = bytearray(read_bytes)
        self._view = memoryview(self._buffer)

    def fileno(self) -> int:
        """The socket's file descriptor (for an event loop's `add_reader`)."""
        return self.sock.fileno()

    def receive_messages(self, timeout: float | None) -> list[Any] | None:
        """The messages completed by one read, after waiting up to `timeout` seconds for data (0:
        not at all; None: without limit). [] when nothing complete arrived; None once the peer has
        closed its end. A frame that does not decode is logged and skipped (the stream stays in step)."""
        if timeout != 0 and not self._poller.poll(None if timeout is None else timeout * 1000):
            return []
        try:
            size = self.sock.recv_into(self._buffer, 0, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return []
        if not size:
            return None
        self._pending += self._view[:size]
        return [message for message in self._split() if message is not None]

    def _split(self) -> list[Any]:
        messages: list[Any] = []
        pending, offset, end = self._pending, 0, len(self._pending)
        with memoryview(pending) as view:  # released before `pending` is resized below
            while end - offset >= _HEADER.size:
                (size,) = _HEADER.unpack_from(pending, offset)
                start = offset + _HEADER.size
                if end - start < size:
                    break
                with view[start:start + size] as frame:
                    messages.append(self._decode(frame))
                offset = start + size
        del pending[:offset]
        return messages

    def _decode(self, frame: memoryview) -> Any:
        try:
            return self.decoder.decode(frame)
        except msgspec.DecodeError:
            logger.exception("frame receiver: a frame of %d bytes does not decode; skipped", len(frame))
            return None


def _checked_size(size: int) -> int:
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {size} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    return size

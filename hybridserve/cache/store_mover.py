"""Asynchronous front of a tier store (`StoreMover`): its puts, gets and deletes run on a background thread.

The engine submits work between steps and collects completion events with `poll()`; it never waits
for a copy or a disk (a slow disk only makes events arrive later). A submit that would overflow
the bounded queue is refused (`False`, counted) rather than blocking; the logical layer treats a
refused demotion as a drop and a refused promotion as a miss. Deletes are never refused: they are
cheap, and a lost one would leave the store and the logical index disagreeing.

CUDA payloads: `submit_put` records an event on the caller's current stream, and the store's copy
waits for it on a side stream; the caller must leave the source tensors unchanged until the put's
completion event arrives (the logical layer keeps the device slot pinned until then).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from hybridserve.cache.tier_store import ObjectStore, Payload, key_to_filename, payload_nbytes

logger = logging.getLogger(__name__)

OpKind = Literal["put", "get", "delete", "call"]
DEFAULT_MAX_PENDING = 64


@dataclass(frozen=True)
class TierEvent:
    """A finished operation: `payload` is the tensors of a successful get (else None), `nbytes`
    what was moved, `seconds` from submit to completion, `evicted` the keys the store dropped to
    make room for a put, `result` what a call returned."""

    key: str
    kind: OpKind
    ok: bool
    payload: Payload | None
    nbytes: int
    seconds: float
    evicted: tuple[str, ...] = ()
    result: Any = None


@dataclass
class MoverStats:
    """Counters of the queue in front of one store."""

    tier: str
    pending: int = 0
    submitted: int = 0
    refused: int = 0  # the queue was full
    cancelled: int = 0
    completed: int = 0


@dataclass
class _Op:
    kind: OpKind
    key: str
    payload: Mapping[str, torch.Tensor] | None
    ready: Any
    submitted: float
    call: Callable[[], Any] | None = None


def _ready_event(payload: Mapping[str, torch.Tensor]) -> Any:
    """A CUDA event recorded on the current stream when `payload` lives on a GPU, else None."""
    if any(t.is_cuda for t in payload.values()):
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        event.record()
        return event
    return None


class StoreMover:
    """Runs one store's operations in FIFO order on a background thread."""

    def __init__(self, store: ObjectStore, *, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.store = store
        self.max_pending = max_pending
        self._queue: deque[_Op] = deque()
        self._events: deque[TierEvent] = deque()
        self._work = threading.Condition()
        self._done = threading.Condition()
        self._closing = False
        self._stats = MoverStats(tier=store.tier)
        self._thread = threading.Thread(target=self._run, name=f"tier-mover-{store.tier}", daemon=True)
        self._thread.start()

    # -- caller side (never blocks on the store) -----------------------------------------------

    def submit_put(self, key: str, payload: Mapping[str, torch.Tensor]) -> bool:
        """Queue a copy of `payload` into the store; False (counted) when the queue is full."""
        key_to_filename(key)  # a key no store can hold is a caller's bug: raise it here
        return self._submit(_Op("put", key, payload, _ready_event(payload), time.perf_counter()), bounded=True)

    def submit_get(self, key: str) -> bool:
        """Queue a read of `key`; its event carries the payload. False (counted) when full."""
        return self._submit(_Op("get", key, None, None, time.perf_counter()), bounded=True)

    def submit_call(self, key: str, call: Callable[[], Any]) -> bool:
        """Queue `call` (a store operation beyond put/get/delete, e.g. a remote lookup) in order
        with the rest; its event carries the result under the label `key`. False when full."""
        return self._submit(_Op("call", key, None, None, time.perf_counter(), call), bounded=True)

    def submit_delete(self, key: str) -> None:
        """Queue the removal of `key` (after the operations queued before it; never refused)."""
        self._submit(_Op("delete", key, None, None, time.perf_counter()), bounded=False)

    def cancel(self, key: str) -> int:
        """Drop the queued, not yet started puts and gets of `key` (no events for them); an
        operation already running completes. Returns how many were dropped."""
        with self._work:
            kept = deque(op for op in self._queue if op.key != key or op.kind == "delete")
            dropped = len(self._queue) - len(kept)
            self._queue = kept
            self._stats.cancelled += dropped
            self._stats.pending = len(self._queue)
        return dropped

    def poll(self, timeout: float = 0.0) -> list[TierEvent]:
        """The events completed since the last poll; waits up to `timeout` seconds for one when
        there are none (the engine's step loop polls with 0)."""
        with self._done:
            if not self._events and timeout > 0:
                self._done.wait_for(lambda: bool(self._events), timeout=timeout)
            events = list(self._events)
            self._events.clear()
        return events

    def stats(self) -> MoverStats:
        """A copy of the queue counters."""
        with self._work:
            return MoverStats(**vars(self._stats))

    def close(self, *, drain: bool = True) -> None:
        """Stop the thread, after finishing the queued operations when `drain` (so write-back
        objects reach the disk before a restart); the store stays open."""
        with self._work:
            if not drain:
                self._stats.cancelled += len(self._queue)
                self._queue.clear()
            self._closing = True
            self._work.notify_all()
        self._thread.join()

    def _submit(self, op: _Op, *, bounded: bool) -> bool:
        with self._work:
            if self._closing:
                raise RuntimeError("tier mover is closed")
            if bounded and sum(1 for queued in self._queue if queued.kind != "delete") >= self.max_pending:
                self._stats.refused += 1
                return False
            self._queue.append(op)
            self._stats.submitted += 1
            self._stats.pending = len(self._queue)
            self._work.notify()
        return True

    # -- background thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._work:
                self._work.wait_for(lambda: bool(self._queue) or self._closing)
                if not self._queue:
                    return
                op = self._queue.popleft()
                self._stats.pending = len(self._queue)
            event = self._execute(op)
            with self._work:
                self._stats.completed += 1
            with self._done:
                self._events.append(event)
                self._done.notify_all()

    def _execute(self, op: _Op) -> TierEvent:
        try:
            if op.kind == "put":
                assert op.payload is not None
                result = self.store.put(op.key, op.payload, op.ready)
                return self._event(op, result.ok, None, result.nbytes, result.evicted)
            if op.kind == "get":
                payload = self.store.get(op.key)
                return self._event(op, payload is not None, payload, payload_nbytes(payload) if payload else 0)
            if op.kind == "call":
                assert op.call is not None
                return self._event(op, True, None, 0, result=op.call())
            return self._event(op, self.store.delete(op.key), None, 0)
        except Exception:  # a store bug must not kill the thread and leave the engine waiting
            logger.exception("tier %s: %s of %r failed", self.store.tier, op.kind, op.key)
            return self._event(op, False, None, 0)

    @staticmethod
    def _event(op: _Op, ok: bool, payload: Payload | None, nbytes: int, evicted: tuple[str, ...] = (),
               result: Any = None) -> TierEvent:
        return TierEvent(op.key, op.kind, ok, payload, nbytes, time.perf_counter() - op.submitted, evicted, result)

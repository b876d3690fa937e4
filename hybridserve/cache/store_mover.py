"""Asynchronous front of a tier store (`StoreMover`): its puts, gets and deletes run on a background thread.

The engine submits work between steps and collects completion events with `poll()`; it never waits
for a copy or a disk (a slow disk only makes events arrive later). A submit that would overflow
the bounded queue is refused (None instead of a sequence number, counted) rather than blocking; the
logical layer treats a refused demotion as a drop and a refused promotion as a miss. Deletes are
never refused: they are cheap, and a lost one would leave the store and the logical index disagreeing.

CUDA payloads: a put records an event on the caller's current stream, and the store's copy
waits for it on a side stream; the caller must leave the source tensors unchanged until the put's
completion event arrives (the logical layer keeps the device slot pinned until then).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch

from hybridserve.cache.tier_store import (
    ObjectStore,
    Payload,
    ReadTarget,
    copy_many_into,
    key_to_filename,
    payload_nbytes,
)

logger = logging.getLogger(__name__)

OpKind = Literal["put", "get", "delete", "call"]
DEFAULT_MAX_PENDING = 64


class TierEvent(NamedTuple):
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
    seq: int = 0  # the operation's sequence number (from its submit)


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
    seq: int = 0
    target: ReadTarget | None = None  # a get that lands in place (its event carries no payload)


_Submission = deque[_Op]  # operations submitted together: queued, run and reported as one unit


def _ready_event(payloads: Sequence[Mapping[str, torch.Tensor]]) -> Any:
    """A CUDA event recorded on the current stream when any of `payloads` lives on a GPU, else None."""
    if any(t.is_cuda for payload in payloads for t in payload.values()):
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        event.record()
        return event
    return None


class StoreMover:
    """Runs one store's operations on a background thread, in two lanes: reads (gets, lookups) go
    ahead of queued writes (puts, deletes, index calls), so a promotion never waits behind the
    demotions that making room for it started; a get of a key with a put or delete still queued
    goes behind it in the write lane. Within a lane, operations run in submission order. The
    operations of one submission are queued, run and reported together (one wake-up for a whole
    entry's objects, not one per object; one store call where the store takes them all at once:
    `get_many`, `put_many`). Each event carries its operation's sequence number,
    counted from the one `submit_many`/`submit_call` returned."""

    def __init__(self, store: ObjectStore, *, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.store = store
        self.max_pending = max_pending
        self._reads: deque[_Submission] = deque()
        self._writes: deque[_Submission] = deque()
        self._queued = 0  # operations in both lanes
        self._mutations: Counter[str] = Counter()  # queued puts and deletes per key
        self._bounded = 0  # queued operations other than deletes (what `max_pending` bounds)
        self._next_seq = 1  # numbers start at 1, so a refused submit (None) is the only falsy answer
        self._events: deque[TierEvent] = deque()
        self._work = threading.Condition()
        self._done = threading.Condition()
        self._closing = False
        self._held = False  # writes wait while the engine runs a forward (`hold_writes`)
        self._released_mark = 1  # operations numbered below this were queued before the last release
        self._overdue_below = 1  # writes numbered below this waited through a whole hold: they run
        self._stats = MoverStats(tier=store.tier)
        self._thread = threading.Thread(target=self._run, name=f"tier-mover-{store.tier}", daemon=True)
        self._thread.start()

    @property
    def reads_in_place(self) -> bool:
        """Whether the store reads objects straight into a target's memory (`get_many_into`: the
        disk and host stores); `submit_reads_into` works with any store, copying others' payloads in."""
        return callable(getattr(self.store, "get_many_into", None))

    # -- caller side (never blocks on the store) -----------------------------------------------

    def submit_put(self, key: str, payload: Mapping[str, torch.Tensor]) -> int | None:
        """Queue a copy of `payload` into the store: its sequence number, or None (counted) when
        the queue is full."""
        return self.submit_many([(key, payload)])

    def submit_get(self, key: str) -> int | None:
        """Queue a read of `key` (its event carries the payload): its sequence number, or None."""
        return self.submit_many([(key, None)])

    def submit_many(self, operations: Sequence[tuple[str, Mapping[str, torch.Tensor] | None]]) -> int | None:
        """Queue a put for each (key, payload) and a get for each (key, None), numbered in order
        from the returned sequence number: all of them, or none (None, counted) when the queue
        cannot take them all."""
        now = time.perf_counter()
        ready = _ready_event([payload for _, payload in operations if payload is not None])
        ops = []
        for key, payload in operations:
            if payload is None:
                ops.append(_Op("get", key, None, None, now))
            else:
                key_to_filename(key)  # a key no store can hold is a caller's bug: raise it here
                ops.append(_Op("put", key, payload, ready, now))
        return self._submit(ops, bounded=True)

    def submit_reads_into(self, reads: Sequence[tuple[str, ReadTarget]]) -> int | None:
        """Queue a get of each key that lands in place in its target (CPU memory the caller holds
        for it until the event arrives; an event with ok=False means the target holds garbage):
        its first sequence number, or None when the queue cannot take them all."""
        now = time.perf_counter()
        return self._submit([_Op("get", key, None, None, now, target=target) for key, target in reads], bounded=True)

    def submit_call(self, key: str, call: Callable[[], Any], *, read: bool = False) -> int | None:
        """Queue `call` (a store operation beyond put/get/delete, e.g. a remote lookup); its event
        carries the result under the label `key`. A `read` call takes the read lane, any other
        runs after the writes queued before it. Its sequence number, or None when full."""
        return self._submit([_Op("call", key, None, None, time.perf_counter(), call)], bounded=True, read=read)

    def submit_delete(self, key: str) -> int:
        """Queue the removal of `key` (after the operations queued before it; never refused)."""
        seq = self._submit([_Op("delete", key, None, None, time.perf_counter())], bounded=False)
        assert seq is not None
        return seq

    def is_queued(self, seq: int) -> bool:
        """Whether the put numbered `seq` is still queued (not started); it may start right after."""
        with self._work:
            return self._queued_put(seq) is not None

    def replace_payload(self, seq: int, payload: Mapping[str, torch.Tensor]) -> bool:
        """Give the put numbered `seq` another payload (the caller's copy of what the first one
        viewed), if it is still queued; False once it has started or finished."""
        with self._work:
            op = self._queued_put(seq)
            if op is None:
                return False
            op.payload = payload
            return True

    def _queued_put(self, seq: int) -> _Op | None:
        """The queued put numbered `seq`, or None once it has started (caller holds `_work`)."""
        return next((op for submission in self._writes for op in submission if op.seq == seq and op.kind == "put"),
                    None)

    def hold_writes(self, held: bool) -> None:
        """While held, queued writes wait (reads still run) unless the queue is half full or the
        oldest write was queued before the last release (it was held through a forward already):
        the engine holds them during a forward, so on a lightly loaded machine background writes
        run between steps instead of competing with the forward for cores and the interpreter
        lock, and under back-to-back steps (gaps too short for the thread to run) a write waits
        through one forward at most, so what it demotes becomes restorable."""
        with self._work:
            if held:
                self._overdue_below = self._released_mark
            else:
                self._released_mark = self._next_seq
            self._held = held
            self._work.notify()

    def cancel(self, key: str) -> int:
        """Drop the queued, not yet started puts and gets of `key` (no events for them); an
        operation already running completes. Returns how many were dropped."""
        with self._work:
            dropped = 0
            for lane in (self._reads, self._writes):
                for submission in list(lane):
                    gone = [op for op in submission if op.key == key and op.kind in ("put", "get")]
                    for op in gone:
                        submission.remove(op)
                        if op.kind == "put":
                            self._mutation_done(key)
                    if not submission:
                        lane.remove(submission)
                    dropped += len(gone)
            self._bounded -= dropped
            self._queued -= dropped
            self._stats.cancelled += dropped
            self._stats.pending = self._queued
        return dropped

    def poll(self, timeout: float = 0.0) -> list[TierEvent]:
        """The events completed since the last poll; waits up to `timeout` seconds when there are
        none, until a submission completes (the engine's step loop polls with 0)."""
        with self._done:
            if not self._events and timeout > 0:
                self._done.wait(timeout=timeout)
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
                self._stats.cancelled += self._queued
                self._queued = 0
                self._reads.clear()
                self._writes.clear()
                self._mutations.clear()
                self._bounded = 0
            self._closing = True
            self._work.notify_all()
        self._thread.join()

    def _submit(self, ops: Sequence[_Op], *, bounded: bool, read: bool = False) -> int | None:
        with self._work:
            if self._closing:
                raise RuntimeError("tier mover is closed")
            if bounded and self._bounded + len(ops) > self.max_pending:
                self._stats.refused += len(ops)
                return None
            first = self._next_seq
            for op in ops:
                op.seq = self._next_seq
                self._next_seq += 1
            if ops:
                self._lane(ops, read).append(deque(ops))
            self._bounded += len(ops) if bounded else 0
            self._queued += len(ops)
            self._stats.submitted += len(ops)
            self._stats.pending = self._queued
            self._work.notify()
        return first

    def _lane(self, ops: Sequence[_Op], read: bool) -> deque[_Submission]:
        """The lane a submission joins: reads when it holds only gets of keys without queued
        mutations and read calls, else writes (its puts and deletes are counted as queued)."""
        reads = all((op.kind == "get" and not self._mutations[op.key]) or (op.kind == "call" and read)
                    for op in ops)
        for op in ops:
            if op.kind in ("put", "delete"):
                self._mutations[op.key] += 1
        return self._reads if reads else self._writes

    def _mutation_done(self, key: str) -> None:
        left = self._mutations[key] - 1
        if left > 0:
            self._mutations[key] = left
        else:
            del self._mutations[key]

    # -- background thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._work:
                self._work.wait_for(lambda: self._runnable_lane() is not None or self._closing)
                if not (self._reads or self._writes):
                    return
            self._run_queued()

    def _runnable_lane(self) -> deque[_Submission] | None:
        """The lane to take an operation from now: reads first; writes unless held (caller holds
        `_work`)."""
        if self._reads:
            return self._reads
        writes = self._writes
        if writes and (not self._held or self._closing or 2 * self._bounded >= self.max_pending
                       or writes[0][0].seq < self._overdue_below):
            return writes
        return None

    def _run_queued(self) -> None:
        """Run queued operations, reads first, until nothing is runnable; each submission's events
        are published together when it completes (or when the run stops part-way through one).
        Stores are called without `_work` held, so a submit never waits for a copy or a disk."""
        events: list[TierEvent] = []
        while True:
            batch: tuple[Callable[[list[_Op]], list[TierEvent]], list[_Op]] | None = None
            with self._work:
                lane = self._runnable_lane()
                if lane is None:
                    break
                submission = lane[0]
                whole = self._whole_submission(lane, submission, events)
                if whole is not None:
                    lane.popleft()
                    batch = (whole, list(submission))
                    for op in submission:
                        if op.kind == "put":
                            self._mutation_done(op.key)
                    self._bounded -= len(submission)
                    self._queued -= len(submission)
                else:
                    op = submission.popleft()
                    finished = not submission
                    if finished:
                        lane.popleft()
                    if op.kind in ("put", "delete"):
                        self._mutation_done(op.key)
                    self._bounded -= op.kind != "delete"
                    self._queued -= 1
                self._stats.pending = self._queued
            if batch is not None:
                self._publish(batch[0](batch[1]))
                continue
            events.append(self._execute(op))
            if finished:
                self._publish(events)
                events = []
        self._publish(events)

    def _whole_submission(self, lane: deque[_Submission], submission: _Submission,
                          events: list[TierEvent]) -> Callable[[list[_Op]], list[TierEvent]] | None:
        """How to run `submission` in one store call, if it is whole (none of it run yet) and all
        gets (`_get_all`) or all puts into a store with `put_many` (`_put_all`); else None (caller
        holds `_work`)."""
        if events:
            return None
        if lane is self._reads and all(op.kind == "get" for op in submission):
            return self._get_all
        if (lane is self._writes and callable(getattr(self.store, "put_many", None))
                and all(op.kind == "put" for op in submission)):
            return self._put_all
        return None

    def _put_all(self, ops: list[_Op]) -> list[TierEvent]:
        """Run a submission of puts as one `put_many` (the host store copies them all with one
        tensor call)."""
        try:
            results = self.store.put_many([(op.key, op.payload) for op in ops], ops[0].ready)  # type: ignore[attr-defined]
        except Exception:  # a store bug must not kill the thread and leave the engine waiting
            logger.exception("tier %s: put of %d objects failed", self.store.tier, len(ops))
            return [self._event(op, False, None, 0) for op in ops]
        return [self._event(op, result.ok, None, result.nbytes, result.evicted)
                for op, result in zip(ops, results, strict=True)]

    def _publish(self, events: list[TierEvent]) -> None:
        """Hand finished operations' events to `poll` and wake a waiting poll."""
        if not events:
            return
        with self._work:
            self._stats.completed += len(events)
        with self._done:
            self._events.extend(events)
            self._done.notify_all()

    def _get_all(self, ops: list[_Op]) -> list[TierEvent]:
        """Run a submission of gets: one `get_many` call where the store has one (one lock for all
        of them), else one get each."""
        if ops[0].target is not None:
            return self._read_all_into(ops)
        get_many = getattr(self.store, "get_many", None)
        if get_many is None:
            return [self._execute(op) for op in ops]
        try:
            payloads = get_many([op.key for op in ops])
        except Exception:
            logger.exception("tier %s: get of %d objects failed", self.store.tier, len(ops))
            return [self._event(op, False, None, 0) for op in ops]
        return [self._event(op, payload is not None, payload, payload_nbytes(payload) if payload else 0)
                for op, payload in zip(ops, payloads, strict=True)]

    def _read_all_into(self, ops: list[_Op]) -> list[TierEvent]:
        """Run gets that land in place: the store reads into the targets where it can
        (`get_many_into`: the disk and host stores), else each payload is copied in here, on this
        thread."""
        keys, targets = [op.key for op in ops], [op.target for op in ops if op.target is not None]
        try:
            if len(targets) != len(ops):
                raise ValueError("a read in place without a target")
            read_into = getattr(self.store, "get_many_into", None)
            if read_into is not None:
                landed = read_into(keys, targets)
            else:
                get_many = getattr(self.store, "get_many", None)
                payloads = get_many(keys) if get_many is not None else [self.store.get(key) for key in keys]
                landed = copy_many_into(targets, payloads)
        except Exception:
            logger.exception("tier %s: read of %d objects in place failed", self.store.tier, len(ops))
            landed = [False] * len(ops)
        return [self._event(op, ok, None, target.layout.nbytes if ok else 0)
                for op, target, ok in zip(ops, targets, landed, strict=False)]

    def _execute(self, op: _Op) -> TierEvent:
        try:
            if op.kind == "put":
                assert op.payload is not None
                result = self.store.put(op.key, op.payload, op.ready)
                return self._event(op, result.ok, None, result.nbytes, result.evicted)
            if op.kind == "get" and op.target is not None:
                return self._read_all_into([op])[0]
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
        return TierEvent(op.key, op.kind, ok, payload, nbytes, time.perf_counter() - op.submitted, evicted, result,
                         op.seq)

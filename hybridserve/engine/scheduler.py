"""Continuous-batching scheduler with joint prefix-cache admission (tensor-free): running requests
first, oldest first, then admissions while budget, slots and blocks allow. Each step is a transaction
(`schedule`, then `apply` or `revert`; docs/prefix-cache.md, Transactions). After a failed forward
of several requests, each of them runs alone until it succeeds (suspects), so only a request that
fails alone is charged the failure."""

from __future__ import annotations

from collections import deque
from typing import NamedTuple, cast

from hybridserve.cache.manager import EndCapture, Fork, JointCacheManager, Restore, blocks_for
from hybridserve.cache.snapshots import Reservation
from hybridserve.config import SchedulerConfig
from hybridserve.engine.request import Request, RequestStatus

__all__ = ["EndCapture", "Fork", "Restore", "ScheduledChunk", "Scheduler", "SchedulerOutput", "blocks_for"]


class ScheduledChunk(NamedTuple):
    """Tokens [start, start + length) of a request computed this step."""

    request: Request
    start: int
    length: int
    new_blocks: list[int]           # blocks taken this step for an already-running request
    captures: list[Reservation]     # snapshot slots reserved for boundaries this chunk crosses
    block_ids: list[int]            # the request's whole block table for this step
    state_slot: int                 # its live GDN state slot


class SchedulerOutput(NamedTuple):
    """What one step runs."""

    chunks: list[ScheduledChunk]
    restores: list[Restore]
    preempted: list[Request]

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """Owns the waiting queue and the running list; every cache resource goes through `cache`."""

    def __init__(self, config: SchedulerConfig, cache: JointCacheManager) -> None:
        self.config = config
        self.cache = cache
        self.block_size = cache.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.suspects: list[Request] = []  # requests of a failed batch, each to run alone once
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        """Queue a request for admission."""
        self.waiting.append(request)

    def finish(self, request: Request, reason: str) -> EndCapture | None:
        """Mark finished and release everything the request owns. An `EndCapture` is returned when
        its end state gets a snapshot slot: the caller copies it, then calls `complete_end_capture`."""
        capture = None
        if request.status is RequestStatus.RUNNING:
            try:
                capture = self.cache.finish(request, keep_end_state=reason in ("stop", "length"))
            finally:
                self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
            self.cache.forget(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        return capture

    def complete_end_capture(self, capture: EndCapture, copied: bool) -> None:
        """Publish the end snapshot if its copy succeeded (else abort it), and free the live slot."""
        self.cache.complete_end_capture(capture, copied)

    def has_unfinished(self) -> bool:
        """Whether any request waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work and take its resources (given back if it raises)."""
        output = SchedulerOutput([], [], [])
        try:
            self._fill(output)
        except Exception:
            self._undo(output, count_failure=False)
            raise
        return output

    def _fill(self, output: SchedulerOutput) -> None:
        self.suspects = [r for r in self.suspects if r.status is not RequestStatus.FINISHED]
        if not self.suspects:
            self._fill_batch(output, frozenset())
        elif not self._fill_alone(output, self.suspects[0]):
            # the suspect cannot start now: run the others (never a suspect) so resources come back
            self._fill_batch(output, frozenset(id(r) for r in self.suspects))

    def _fill_alone(self, output: SchedulerOutput, request: Request) -> bool:
        """A step of `request` only (False, nothing taken, when it cannot be admitted now)."""
        chunks, restores, preempted = output
        budget = self.config.max_num_batched_tokens
        if request.status is RequestStatus.WAITING:
            if len(self.running) >= self.config.max_num_seqs:
                return False
            restore = self.cache.admit(request)
            if restore is None:
                return False
            self.waiting.remove(request)
            self._start(request, restore, restores, chunks, budget)
            return True
        remaining = request.num_tokens - request.num_computed_tokens
        length = 1 if remaining == 1 else min(remaining, budget, request.max_chunk_tokens)
        new_blocks = self._grow(request, request.num_computed_tokens + length, preempted)
        if new_blocks is not None:
            self._add_chunk(chunks, request, length, new_blocks)
        return True

    def _fill_batch(self, output: SchedulerOutput, skip: frozenset[int]) -> None:
        """Running requests first, then admissions, leaving out the requests whose id is in `skip`."""
        budget = self.config.max_num_batched_tokens
        prefill_budget = self._prefill_budget(budget)
        chunks, restores, preempted = output
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if id(request) in skip:
                index += 1
                continue
            remaining = request.num_tokens - request.num_computed_tokens
            length = 1 if remaining == 1 else min(remaining, budget, prefill_budget, request.max_chunk_tokens)
            if length == 0:
                index += 1  # a prefill waiting for budget; it keeps what it holds
                continue
            new_blocks = self._grow(request, request.num_computed_tokens + length, preempted)
            if new_blocks is None:
                break  # the request preempted itself
            self._add_chunk(chunks, request, length, new_blocks)
            budget -= length
            prefill_budget -= length if remaining > 1 else 0
            index += 1
        while (self.waiting and min(budget, prefill_budget) > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs and id(self.waiting[0]) not in skip):
            restore = self.cache.admit(self.waiting[0])
            if restore is None:
                break
            length = self._start(self.waiting.popleft(), restore, restores, chunks, min(budget, prefill_budget))
            budget -= length
            prefill_budget -= length

    def _start(self, request: Request, restore: Restore, restores: list[Restore], chunks: list[ScheduledChunk],
               budget: int) -> int:
        """Run an admitted request from its restore: its first chunk, of at most `budget` tokens."""
        request.num_computed_tokens = restore.num_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        restores.append(restore)
        length = min(request.num_tokens - request.num_computed_tokens, budget, request.max_chunk_tokens)
        self._add_chunk(chunks, request, length, [])
        return length

    def _prefill_budget(self, budget: int) -> int:
        """Prefill tokens allowed this step (docs/serving.md, Scheduling)."""
        cap = self.config.max_prefill_tokens_during_decode
        prefilling = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens > 1)
        admissible = min(len(self.waiting), self.config.max_num_seqs - len(self.running))
        if not cap or prefilling + admissible > len(self.running) - prefilling:
            return budget
        return min(budget, cap * max(1, prefilling + admissible))

    def _grow(self, request: Request, num_tokens: int, preempted: list[Request]) -> list[int] | None:
        """Blocks so `request` covers `num_tokens`, preempting the newest (None: it was preempted itself)."""
        while True:
            new_blocks = self.cache.grow(request, num_tokens)
            if new_blocks is not None:
                return new_blocks
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return None

    def _add_chunk(self, chunks: list[ScheduledChunk], request: Request, length: int, new_blocks: list[int]) -> None:
        """Record the chunk, then reserve its snapshot slots into it (where `revert` finds them)."""
        start = request.num_computed_tokens
        chunk = ScheduledChunk(request, start, length, new_blocks, [], self.cache.block_table(request),
                               self.cache.state_slot(request))
        chunks.append(chunk)
        self.cache.reserve_captures(request, start, length, chunk.captures)

    def fork(self, parent: Request, child: Request) -> Fork | None:
        """Run `child` from its fully computed `parent`'s state; None when there is no room."""
        if parent.status is not RequestStatus.RUNNING or child.status is not RequestStatus.WAITING:
            raise ValueError("fork() needs a running parent and a waiting child")
        if child.token_ids != parent.token_ids:
            raise ValueError("a forked child must have its parent's tokens")
        if len(self.running) >= self.config.max_num_seqs:
            return None
        fork = self.cache.fork(parent, child)
        if fork is None:
            return None
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        return fork

    def apply(self, output: SchedulerOutput, failed_snapshot_slots: set[int]) -> list[Request]:
        """Commit a successful step; the requests to sample. If it raises, the caller `finish`es the step's."""
        committed: list[Restore] = []
        try:
            return self._apply(output, failed_snapshot_slots, committed)
        except Exception:
            for restore in output.restores[len(committed):]:  # `_apply` commits these in order
                self.cache.drop_restore_holds(restore)
            for chunk in output.chunks:
                self.cache.abort_open(chunk.captures)
            raise

    def _apply(self, output: SchedulerOutput, failed_snapshot_slots: set[int], committed: list[Restore]
               ) -> list[Request]:
        for restore in output.restores:
            committed.append(restore)
            self.cache.commit_restore(restore)
            request = cast(Request, restore.request)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = restore.num_tokens
        to_sample = []
        ran = {id(chunk.request) for chunk in output.chunks}
        self.suspects = [r for r in self.suspects if id(r) not in ran]
        for chunk in output.chunks:
            request = chunk.request
            request.num_computed_tokens += chunk.length
            request.failed_steps = 0
            self.cache.commit_chunk(request, chunk.captures, failed_snapshot_slots)
            if request.num_computed_tokens == request.num_tokens:
                to_sample.append(request)
        return to_sample

    def revert(self, output: SchedulerOutput) -> None:
        """Undo `schedule` after a failed forward: nothing the step took stays taken. A request that
        ran alone is charged the failure; the requests of a failed batch become suspects instead."""
        requests = list({id(chunk.request): chunk.request for chunk in output.chunks}.values())
        if len(requests) > 1:
            known = {id(r) for r in self.suspects}
            self.suspects += [r for r in requests if id(r) not in known]
        self._undo(output, count_failure=len(requests) == 1)

    def _undo(self, output: SchedulerOutput, count_failure: bool) -> None:
        """Give back everything `output` holds; `count_failure` charges its requests a failed step."""
        admitted = {id(r.request) for r in output.restores}
        for chunk in output.chunks:
            chunk.request.failed_steps += count_failure
            new_blocks = chunk.new_blocks if id(chunk.request) not in admitted else []
            self.cache.revert_chunk(chunk.request, new_blocks, chunk.captures)
        for restore in reversed(output.restores):
            request = cast(Request, restore.request)
            self.running.remove(request)
            self.cache.revert_restore(restore)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)

    def _preempt(self, request: Request) -> None:
        """Free a running request's resources; it recomputes later (from the prefix cache if it can)."""
        self.running.remove(request)
        self.cache.release(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def preempt_all(self) -> None:
        """Preempt every running request, newest first, so each waits at the front in its old order."""
        for request in reversed(list(self.running)):
            self._preempt(request)

    def check_integrity(self) -> None:
        """Pools consistent, and every block and slot reference held by exactly the running requests."""
        self.cache.check_integrity(self.running, list(self.waiting))
        queued = {id(r) for r in [*self.running, *self.waiting]}
        live = [r for r in self.suspects if r.status is not RequestStatus.FINISHED]
        if any(id(r) not in queued for r in live):
            raise AssertionError("a suspect request is neither running nor waiting")

"""Continuous-batching scheduler with joint prefix-cache admission (tensor-free).

Each step: running requests first (decodes and unfinished prefills, oldest first), then new
admissions while the token budget, sequence slots and KV blocks allow. Every step is a
transaction: `schedule` takes resources, the runner computes, then `apply` commits progress or
`revert` gives back exactly what `schedule` took.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from hybridserve.cache.block_pool import BlockPool
from hybridserve.cache.prefix_cache import PrefixCache, PrefixLookup
from hybridserve.cache.snapshots import Reservation, ReserveStatus, SnapshotPool
from hybridserve.cache.state_slots import StateSlotPool
from hybridserve.config import CacheConfig, SchedulerConfig
from hybridserve.engine.request import Request, RequestStatus


class ScheduledChunk(NamedTuple):
    """Tokens [start, start + length) of a request computed this step."""

    request: Request
    start: int
    length: int
    new_blocks: list[int]           # blocks taken this step for an already-running request
    captures: list[Reservation]     # snapshot slots reserved for boundaries this chunk crosses


class Restore(NamedTuple):
    """An admission: load the live slot from a snapshot (or zero it for a cold start)."""

    request: Request
    state_slot: int
    snapshot_slot: int | None
    num_tokens: int


class SchedulerOutput(NamedTuple):
    """What one step runs."""

    chunks: list[ScheduledChunk]
    restores: list[Restore]
    preempted: list[Request]

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Fork(NamedTuple):
    """A sequence placed beside its running parent: copy the parent's live GDN state slot, and its
    partially filled last KV block when the prompt does not end on a block boundary."""

    src_state_slot: int
    dst_state_slot: int
    src_block: int | None
    dst_block: int | None


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class Scheduler:
    """Owns the waiting queue, the running list and the logical pools."""

    def __init__(self, cache_config: CacheConfig, config: SchedulerConfig, block_pool: BlockPool,
                 state_slots: StateSlotPool, snapshots: SnapshotPool | None) -> None:
        self.cache_config = cache_config
        self.config = config
        self.block_size = cache_config.block_size
        self.block_pool = block_pool
        self.state_slots = state_slots
        self.snapshots = snapshots
        self.prefix_cache = (PrefixCache(block_pool, snapshots, cache_config.block_size,
                                         cache_config.snapshot_interval) if snapshots is not None else None)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queue management ---------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished and release everything the request owns (running or waiting)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._release(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work, taking blocks, state slots and snapshot reservations."""
        budget = self.config.max_num_batched_tokens
        prefill_budget = self._prefill_budget(budget)
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            remaining = request.num_tokens - request.num_computed_tokens
            length = 1 if remaining == 1 else min(remaining, budget, prefill_budget)
            if length == 0:
                index += 1  # a prefill waiting for budget; it keeps what it holds
                continue
            new_blocks = self._grow(request, request.num_computed_tokens + length, preempted)
            if new_blocks is None:
                break  # the request preempted itself
            chunks.append(self._chunk(request, length, new_blocks))
            budget -= length
            prefill_budget -= length if remaining > 1 else 0
            index += 1
        restores: list[Restore] = []
        while (self.waiting and min(budget, prefill_budget) > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            restore = self._admit(self.waiting[0])
            if restore is None:
                break
            request = self.waiting.popleft()
            restores.append(restore)
            length = min(request.num_tokens - request.num_computed_tokens, budget, prefill_budget)
            chunks.append(self._chunk(request, length, []))
            budget -= length
            prefill_budget -= length
        return SchedulerOutput(chunks, restores, preempted)

    def _prefill_budget(self, budget: int) -> int:
        """Prefill tokens allowed this step: capped while any request decodes, so one long
        prompt cannot stall everyone's next token for a whole long step."""
        cap = self.config.max_prefill_tokens_during_decode
        decoding = any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        return min(budget, cap) if cap and decoding else budget

    def _grow(self, request: Request, num_tokens: int, preempted: list[Request]) -> list[int] | None:
        """Blocks so `request` covers `num_tokens`, preempting the newest others if needed.
        None when the request itself had to be preempted."""
        needed = blocks_for(num_tokens, self.block_size) - len(request.block_ids)
        while needed > 0 and not self.block_pool.can_allocate(needed):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return None
        new_blocks = self.block_pool.allocate(needed) if needed > 0 else []
        request.block_ids.extend(new_blocks)
        return new_blocks

    def _admit(self, request: Request) -> Restore | None:
        """Joint lookup + resource check for the head of the queue; None if it must wait."""
        if self.state_slots.num_free_slots == 0:
            return None
        lookup = self._lookup(request)
        hit = lookup.hit if lookup is not None else None
        hit_blocks = hit.block_ids if hit is not None else []
        new_needed = blocks_for(request.num_tokens, self.block_size) - len(hit_blocks)
        revived = sum(1 for b in hit_blocks if self.block_pool.ref_count(b) == 0)
        if new_needed + revived > self.block_pool.num_free_blocks:
            return None
        self.block_pool.touch(hit_blocks)
        request.block_ids = list(hit_blocks) + self.block_pool.allocate(new_needed)
        request.num_registered_blocks = len(hit_blocks)
        request.state_slot = self.state_slots.allocate()
        request.num_computed_tokens = hit.num_tokens if hit is not None else 0
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        snapshot_slot = None
        if lookup is not None:
            self._prefix_cache().record(lookup)
            snapshot_slot = hit.snapshot_slot if hit is not None else None
            if snapshot_slot is not None:
                self._snapshot_pool().pin(snapshot_slot)
        return Restore(request, request.state_slot, snapshot_slot, request.num_computed_tokens)

    def _lookup(self, request: Request) -> PrefixLookup | None:
        if self.prefix_cache is None:
            return None
        hashes = request.block_hashes(request.num_tokens // self.block_size)
        lookup = self.prefix_cache.lookup(hashes, request.num_tokens)
        slot = lookup.hit.snapshot_slot
        if slot is not None:
            # The snapshot must describe exactly this prefix before anyone restores it.
            assert self.snapshots is not None and lookup.key is not None
            assert self.snapshots.key_of(slot) == lookup.key, "snapshot key mismatch"
            assert self.snapshots.num_tokens_of(slot) == lookup.hit.num_tokens, "snapshot position mismatch"
        return lookup

    def _chunk(self, request: Request, length: int, new_blocks: list[int]) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(request, start, length, new_blocks, self._reserve_captures(request, start, length))

    def _reserve_captures(self, request: Request, start: int, length: int) -> list[Reservation]:
        if self.snapshots is None:
            return []
        interval = self.cache_config.snapshot_interval
        first = (start // interval + 1) * interval
        captures = []
        for boundary in range(first, start + length + 1, interval):
            key = request.block_hashes(boundary // self.block_size)[-1]
            reservation = self.snapshots.reserve(key, boundary)
            if reservation.status is ReserveStatus.RESERVED:
                captures.append(reservation)
        return captures

    def fork(self, parent: Request, child: Request) -> Fork | None:
        """Run `child` (same tokens as `parent`, whose computed tokens are all its tokens) from the
        parent's computed state: full blocks are shared (one more reference each), the partial
        last block is copied into a new block. None when no state slot or block is free; the
        caller then queues the child to compute its prompt itself."""
        assert parent.status is RequestStatus.RUNNING and parent.num_computed_tokens == parent.num_tokens
        assert child.token_ids == parent.token_ids and child.status is RequestStatus.WAITING
        num_full = parent.num_computed_tokens // self.block_size
        partial = len(parent.block_ids) > num_full
        if (self.state_slots.num_free_slots == 0 or len(self.running) >= self.config.max_num_seqs
                or (partial and not self.block_pool.can_allocate(1))):
            return None
        shared = parent.block_ids[:num_full]
        self.block_pool.touch(shared)
        copied = self.block_pool.allocate(1) if partial else []
        child.block_ids = list(shared) + copied
        child.num_registered_blocks = min(parent.num_registered_blocks, num_full)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.state_slot = self.state_slots.allocate()
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        assert parent.state_slot is not None
        return Fork(parent.state_slot, child.state_slot, parent.block_ids[num_full] if partial else None,
                    copied[0] if partial else None)

    # -- transaction end --------------------------------------------------------------------
    def apply(self, output: SchedulerOutput, failed_snapshot_slots: set[int]) -> list[Request]:
        """Commit a successful step; returns the requests whose next token must be sampled."""
        for restore in output.restores:
            if restore.snapshot_slot is not None:
                self._snapshot_pool().unpin(restore.snapshot_slot)
            if restore.request.num_cached_tokens is None:
                restore.request.num_cached_tokens = restore.num_tokens
        to_sample = []
        for chunk in output.chunks:
            request = chunk.request
            request.num_computed_tokens += chunk.length
            request.failed_steps = 0
            self._register_full_blocks(request)
            for reservation in chunk.captures:
                if reservation.slot in failed_snapshot_slots:
                    self._snapshot_pool().abort(reservation)
                else:
                    self._snapshot_pool().publish(reservation)
            if request.num_computed_tokens == request.num_tokens:
                to_sample.append(request)
        return to_sample

    def revert(self, output: SchedulerOutput) -> None:
        """Undo `schedule` after a failed forward: nothing the step took stays taken."""
        admitted = {id(r.request) for r in output.restores}
        for chunk in output.chunks:
            for reservation in chunk.captures:
                self._snapshot_pool().abort(reservation)
            chunk.request.failed_steps += 1
            if chunk.new_blocks and id(chunk.request) not in admitted:
                del chunk.request.block_ids[-len(chunk.new_blocks):]
                self.block_pool.free(list(reversed(chunk.new_blocks)))
        for restore in reversed(output.restores):
            if restore.snapshot_slot is not None:
                self._snapshot_pool().unpin(restore.snapshot_slot)
            self.running.remove(restore.request)
            self._release(restore.request)
            self.waiting.appendleft(restore.request)

    def _snapshot_pool(self) -> SnapshotPool:
        """The snapshot pool; only reached on paths that exist when the prefix cache is on."""
        assert self.snapshots is not None, "prefix cache is disabled"
        return self.snapshots

    def _prefix_cache(self) -> PrefixCache:
        assert self.prefix_cache is not None, "prefix cache is disabled"
        return self.prefix_cache

    def _register_full_blocks(self, request: Request) -> None:
        if self.prefix_cache is None:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_registered_blocks:
            return
        hashes = request.block_hashes(num_full)
        for index in range(request.num_registered_blocks, num_full):
            self.block_pool.register(request.block_ids[index], hashes[index])
        request.num_registered_blocks = num_full

    def _preempt(self, request: Request) -> None:
        """Free a running request's resources; it recomputes later (from the prefix cache if it can)."""
        self.running.remove(request)
        self._release(request)
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _release(self, request: Request) -> None:
        """Give back blocks (tail first, so shared prefixes stay cached longest) and the state slot."""
        self.block_pool.free(list(reversed(request.block_ids)))
        request.block_ids = []
        request.num_registered_blocks = 0
        request.num_computed_tokens = 0
        if request.state_slot is not None:
            self.state_slots.free(request.state_slot)
            request.state_slot = None
        request.status = RequestStatus.WAITING

    def check_integrity(self) -> None:
        """Pools consistent, and every block/slot reference is held by exactly the running requests."""
        self.block_pool.check_integrity()
        self.state_slots.check_integrity()
        if self.snapshots is not None:
            self.snapshots.check_integrity()
        held: dict[int, int] = {}
        for request in self.running:
            assert request.state_slot is not None, f"running request {request.request_id} has no state slot"
            for block in request.block_ids:
                held[block] = held.get(block, 0) + 1
        for block, count in held.items():
            assert self.block_pool.ref_count(block) == count, f"block {block}: refcount mismatch"
        assert self.block_pool.num_used_blocks == len(held), "a used block has no owner"
        assert self.state_slots.num_free_slots == self.state_slots.num_slots - len(self.running), "state slot leak"
        for request in self.waiting:
            assert not request.block_ids and request.state_slot is None, "waiting request holds resources"

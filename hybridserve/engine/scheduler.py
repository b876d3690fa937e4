"""Continuous-batching scheduler with joint prefix-cache admission (tensor-free).

Each step: running requests first (decodes and unfinished prefills, oldest first), then new
admissions while the token budget, sequence slots and KV blocks allow. Every step is a
transaction: `schedule` takes resources, the runner computes, then `apply` commits progress or
`revert` gives back exactly what `schedule` took.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from hybridserve.cache.block_pool import BlockHash, BlockPool
from hybridserve.cache.policy import CachePolicy, RequestView
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
    """An admission: load the live slot from a snapshot (or zero it for a cold start). With
    `kv_copy = (source, target)` the hit ends inside a block: copy the cached partial block into
    the request's own block first (the restore holds a reference on the source for the step).
    `lookup` is counted in the prefix-cache stats when the step commits, once per request."""

    request: Request
    state_slot: int
    snapshot_slot: int | None
    num_tokens: int
    kv_copy: tuple[int, int] | None = None
    lookup: PrefixLookup | None = None


class EndCapture(NamedTuple):
    """A finished request's final state on its way into a snapshot slot: the capture owns the
    live slot until `Scheduler.complete_end_capture` publishes (or aborts) and frees it."""

    reservation: Reservation
    state_slot: int


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
                 state_slots: StateSlotPool, snapshots: SnapshotPool | None,
                 policy: CachePolicy | None = None) -> None:
        self.cache_config = cache_config
        self.config = config
        self.block_size = cache_config.block_size
        self.block_pool = block_pool
        self.state_slots = state_slots
        self.snapshots = snapshots
        self.policy = policy
        self.prefix_cache = None
        if snapshots is not None:
            assert policy is not None, "a prefix cache needs a cache policy"
            policy.bind(block_pool, snapshots)
            block_pool.on_evict = self._drop_snapshot_of
            self.prefix_cache = PrefixCache(block_pool, snapshots, cache_config.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queue management ---------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def finish(self, request: Request, reason: str) -> EndCapture | None:
        """Mark finished and release everything the request owns (running or waiting).

        When the policy keeps request ends and the request ended normally, its final state is
        reserved a snapshot slot: the returned `EndCapture` then holds the live slot, and the
        caller copies it and calls `complete_end_capture`."""
        capture = None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            if reason in ("stop", "length"):
                capture = self._reserve_end_capture(request)
            self._release(request, finished=True)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        return capture

    def _reserve_end_capture(self, request: Request) -> EndCapture | None:
        """Reserve a snapshot of the state after the last computed token; registers the partial
        last block's KV under its tail hash so the boundary is a joint one."""
        end = request.num_computed_tokens
        if self.snapshots is None or self.policy is None or not self.policy.capture_at_end or end == 0:
            return None
        full, partial = divmod(end, self.block_size)
        key = request.boundary_key(end)
        if partial:
            parent = request.block_hashes(full)[-1] if full else None
            self.block_pool.register_tail(request.block_ids[full], key, parent, partial)
        reservation = self.snapshots.reserve(key, end, self._parent_key(request, end))
        if reservation.status is not ReserveStatus.RESERVED:
            if reservation.status is ReserveStatus.DUPLICATE:
                request.snapshot_depth, request.snapshot_key = end, key
            return None
        assert request.state_slot is not None
        capture = EndCapture(reservation, request.state_slot)
        request.snapshot_depth, request.snapshot_key = end, key
        request.state_slot = None  # the capture owns the live slot now
        return capture

    def complete_end_capture(self, capture: EndCapture, copied: bool) -> None:
        """Publish the end snapshot if its copy succeeded (else abort it), and free the live slot."""
        if copied:
            self._snapshot_pool().publish(capture.reservation)
        else:
            self._snapshot_pool().abort(capture.reservation)
        self.state_slots.free(capture.state_slot)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work, taking blocks, state slots and snapshot reservations. Every
        resource is recorded in the output as it is taken, so if scheduling raises, what it
        took so far is given back (as by `revert`) before the exception propagates."""
        output = SchedulerOutput([], [], [])
        try:
            self._fill(output)
        except Exception:
            self._undo(output, count_failure=False)
            raise
        return output

    def _fill(self, output: SchedulerOutput) -> None:
        budget = self.config.max_num_batched_tokens
        prefill_budget = self._prefill_budget(budget)
        chunks, restores, preempted = output
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
            self._add_chunk(chunks, request, length, new_blocks)
            budget -= length
            prefill_budget -= length if remaining > 1 else 0
            index += 1
        while (self.waiting and min(budget, prefill_budget) > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            restore = self._admit(self.waiting[0])
            if restore is None:
                break
            request = self.waiting.popleft()
            restores.append(restore)
            remaining = request.num_tokens - request.num_computed_tokens
            length = min(remaining, budget, prefill_budget)
            self._add_chunk(chunks, request, length, [])
            budget -= length
            prefill_budget -= length

    def _prefill_budget(self, budget: int) -> int:
        """Prefill tokens allowed this step. While requests decode and at least as many as are
        owed prompt tokens (running partial prefills and waiting requests that fit the batch),
        each of those may add `max_prefill_tokens_during_decode`: one long prompt cannot stall
        everyone's next token for a whole long step. When the requests owed prompt tokens
        outnumber the decoding ones (a burst arriving just after the first of it started), the
        step takes them whole: a long step then delays fewer streams than it starts, and slicing
        the burst would make every one of its requests wait through many mixed steps."""
        cap = self.config.max_prefill_tokens_during_decode
        prefilling = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens > 1)
        admissible = min(len(self.waiting), self.config.max_num_seqs - len(self.running))
        if not cap or prefilling + admissible > len(self.running) - prefilling:
            return budget
        return min(budget, cap * max(1, prefilling + admissible))

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
        held = hit_blocks + ([hit.tail_block] if hit is not None and hit.tail_block is not None else [])
        new_needed = blocks_for(request.num_tokens, self.block_size) - len(hit_blocks)
        revived = sum(1 for b in held if self.block_pool.ref_count(b) == 0)
        if new_needed + revived > self.block_pool.num_free_blocks:
            return None
        snapshot_slot = hit.snapshot_slot if hit is not None else None
        self.block_pool.touch(held)
        request.block_ids = list(hit_blocks)
        try:  # all or nothing: a failure gives back what this admission took
            request.block_ids += self.block_pool.allocate(new_needed)
            request.state_slot = self.state_slots.allocate()
            if snapshot_slot is not None:
                self._snapshot_pool().pin(snapshot_slot)
        except Exception:
            self._release(request)
            if len(held) > len(hit_blocks):
                self.block_pool.free(held[len(hit_blocks):])
            raise
        request.num_registered_blocks = len(hit_blocks)
        request.num_computed_tokens = hit.num_tokens if hit is not None else 0
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        kv_copy = None
        if lookup is not None and hit is not None:
            request.branch_point = lookup.kv_match_tokens if lookup.kv_match_tokens > hit.num_tokens else 0
            request.snapshot_depth, request.snapshot_key = hit.num_tokens, lookup.key
            if hit.tail_block is not None:
                kv_copy = (hit.tail_block, request.block_ids[len(hit_blocks)])
        return Restore(request, request.state_slot, snapshot_slot, request.num_computed_tokens, kv_copy, lookup)

    def _lookup(self, request: Request) -> PrefixLookup | None:
        if self.prefix_cache is None:
            return None
        hashes = request.block_hashes(request.num_tokens // self.block_size)
        lookup = self.prefix_cache.lookup(hashes, request.token_ids, request.extra_keys, request.block_hash)
        slot = lookup.hit.snapshot_slot
        if slot is not None:
            # The snapshot must describe exactly this prefix before anyone restores it.
            assert self.snapshots is not None and lookup.key is not None
            assert self.snapshots.key_of(slot) == lookup.key, "snapshot key mismatch"
            assert self.snapshots.num_tokens_of(slot) == lookup.hit.num_tokens, "snapshot position mismatch"
        return lookup

    def _add_chunk(self, chunks: list[ScheduledChunk], request: Request, length: int, new_blocks: list[int]) -> None:
        """Record the chunk first, then reserve its snapshot slots into it (so a failure while
        reserving leaves every reservation where `revert` finds it)."""
        start = request.num_computed_tokens
        chunk = ScheduledChunk(request, start, length, new_blocks, [])
        chunks.append(chunk)
        self._reserve_captures(request, start, length, chunk.captures)

    def _reserve_captures(self, request: Request, start: int, length: int, captures: list[Reservation]) -> None:
        """Snapshot slots for the boundaries the policy wants from this chunk's forward."""
        if self.snapshots is None or self.policy is None:
            return
        view = self._view(request)
        for boundary in self.policy.captures(view, start, length):
            key = request.boundary_key(boundary)
            reservation = self.snapshots.reserve(key, boundary, self._parent_key(request, boundary),
                                                 self.policy.is_opportunistic(view, boundary),
                                                 branch=boundary == request.branch_point)
            if reservation.status is ReserveStatus.RESERVED:
                captures.append(reservation)
            if reservation.status is not ReserveStatus.SKIPPED:
                request.snapshot_depth, request.snapshot_key = boundary, key

    @staticmethod
    def _view(request: Request) -> RequestView:
        return RequestView(request.num_prompt_tokens, request.num_tokens, request.branch_point,
                           request.snapshot_depth)

    @staticmethod
    def _parent_key(request: Request, boundary: int) -> BlockHash | None:
        """The snapshot on the request's path just below `boundary`, if one is known."""
        return request.snapshot_key if 0 < request.snapshot_depth < boundary else None

    def _drop_snapshot_of(self, block_hash: BlockHash) -> None:
        """A cached KV block was reclaimed: a snapshot keyed by the prefix it ends is now useless."""
        if self.snapshots is not None:
            self.snapshots.evict(block_hash)

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
        """Commit a successful step; returns the requests whose next token must be sampled.

        If committing raises, every pin and reservation of the step still open is released
        before the exception propagates; the step's requests have then advanced an unknown
        part of the way, so the caller must finish them (`finish`), which frees the rest.
        """
        unpinned: list[Restore] = []
        try:
            return self._apply(output, failed_snapshot_slots, unpinned)
        except Exception:
            self._release_step_holds(output, unpinned)
            raise

    def _apply(self, output: SchedulerOutput, failed_snapshot_slots: set[int], unpinned: list[Restore]
               ) -> list[Request]:
        for restore in output.restores:
            unpinned.append(restore)
            if restore.snapshot_slot is not None:
                self._snapshot_pool().unpin(restore.snapshot_slot)
            if restore.kv_copy is not None:
                self.block_pool.free([restore.kv_copy[0]])
            request = restore.request
            if request.num_cached_tokens is None:
                request.num_cached_tokens = restore.num_tokens
            if restore.lookup is not None and not request.prefix_lookup_counted:
                request.prefix_lookup_counted = True  # once per request, across reverts and preemptions
                self._prefix_cache().record(restore.lookup)
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

    def _release_step_holds(self, output: SchedulerOutput, unpinned: list[Restore]) -> None:
        """After a failed `apply`: drop the pins and abort the reservations it did not reach."""
        for restore in output.restores[len(unpinned):]:  # `_apply` releases these in order
            if restore.snapshot_slot is not None:
                self._snapshot_pool().unpin(restore.snapshot_slot)
            if restore.kv_copy is not None:
                self.block_pool.free([restore.kv_copy[0]])
        for chunk in output.chunks:
            for reservation in chunk.captures:
                if self._snapshot_pool().is_reserved(reservation):
                    self._snapshot_pool().abort(reservation)

    def revert(self, output: SchedulerOutput) -> None:
        """Undo `schedule` after a failed forward: nothing the step took stays taken."""
        self._undo(output, count_failure=True)

    def _undo(self, output: SchedulerOutput, count_failure: bool) -> None:
        """Give back everything `output` holds; `count_failure` charges its requests a failed step."""
        admitted = {id(r.request) for r in output.restores}
        for chunk in output.chunks:
            for reservation in chunk.captures:
                self._snapshot_pool().abort(reservation)
            chunk.request.failed_steps += count_failure
            if chunk.new_blocks and id(chunk.request) not in admitted:
                del chunk.request.block_ids[-len(chunk.new_blocks):]
                self.block_pool.free(list(reversed(chunk.new_blocks)))
        for restore in reversed(output.restores):
            if restore.snapshot_slot is not None:
                self._snapshot_pool().unpin(restore.snapshot_slot)
            if restore.kv_copy is not None:
                self.block_pool.free([restore.kv_copy[0]])
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

    def _release(self, request: Request, finished: bool = False) -> None:
        """Give back blocks (tail first, so shared prefixes stay cached longest) and the state slot.
        A finished request's blocks that its policy judges worthless go to the free list's front."""
        cold_from = len(request.block_ids)
        if finished and self.policy is not None:
            position = self.policy.evict_kv_first(self._view(request))
            if position is not None:
                cold_from = min(cold_from, blocks_for(position, self.block_size))
        if cold_from < len(request.block_ids):
            self.block_pool.free(list(reversed(request.block_ids[cold_from:])), evict_first=True)
        self.block_pool.free(list(reversed(request.block_ids[:cold_from])))
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

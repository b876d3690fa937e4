"""`JointCacheManager`, the scheduler's only door to cache state (tensor-free: the engine and the
trace simulator drive the same object). It owns the pools, the joint lookup and the policy, and
keeps each sequence's cache bookkeeping; docs/prefix-cache.md walks through its verbs. A second
tier (host, disk, remote) plugs in here without touching the scheduler: it demotes at the evictions
(`_on_block_evicted`, the policy's snapshot victims), extends `_lookup`, and adds a source to
`Restore`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from hybridserve.cache.block_pool import BlockHash, BlockPool, block_hashes_for, hash_tail
from hybridserve.cache.policy import CachePolicy, RequestView
from hybridserve.cache.prefix_cache import PrefixCache, PrefixCacheStats, PrefixHit, PrefixLookup
from hybridserve.cache.snapshots import Reservation, ReserveStatus, SnapshotPool, SnapshotPoolStats
from hybridserve.cache.state_slots import StateSlotPool


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class CacheSequence(Protocol):
    """What the manager reads of a sequence: its tokens, progress and tenant."""

    token_ids: list[int]
    cache_salt: str | None
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...


class Restore(NamedTuple):
    """An admission: load the live slot from a snapshot (or zero it for a cold start). `kv_copy =
    (source, target)`: the hit ends inside a block, copy the cached partial block into the
    sequence's own (the restore holds a reference on the source for the step)."""

    request: CacheSequence
    state_slot: int
    snapshot_slot: int | None
    num_tokens: int
    kv_copy: tuple[int, int] | None = None
    lookup: PrefixLookup | None = None


class EndCapture(NamedTuple):
    """A finished sequence's final state on its way into a snapshot slot; owns the live slot until
    `complete_end_capture`."""

    reservation: Reservation
    state_slot: int


class Fork(NamedTuple):
    """A sequence placed beside its running parent: copy the parent's live state slot, and its
    partial last KV block if any."""

    src_state_slot: int
    dst_state_slot: int
    src_block: int | None
    dst_block: int | None


class CacheUsage(NamedTuple):
    """Pool capacities and occupancy (for stats and metrics)."""

    kv_blocks: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached_free: int
    state_slots: int
    state_slots_free: int
    snapshots_reserved: int
    snapshots_pinned: int


@dataclass(eq=False)
class _SequenceCache:
    """The manager's record of one sequence; holding `owner` keeps the `id()` that keys it unique."""

    owner: CacheSequence
    block_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None
    num_registered_blocks: int = 0
    branch_point: int = 0                      # KV matched this deep at admission, with no snapshot there
    snapshot_depth: int = 0                    # deepest snapshot on its path (restored or taken)
    snapshot_key: BlockHash | None = None      # ... and its key (the parent of the next one taken)
    lookup_counted: bool = False               # its admission is in the prefix-cache stats
    hashes: list[BlockHash] = field(default_factory=list)  # full-block hashes computed so far


class JointCacheManager:
    """Owns the pools, the joint lookup and the policy. `snapshots is None` disables the prefix
    cache; blocks and live slots are still managed."""

    def __init__(self, block_size: int, block_pool: BlockPool, state_slots: StateSlotPool,
                 snapshots: SnapshotPool | None, policy: CachePolicy | None = None,
                 block_hash: str = "xxh3_128") -> None:
        if snapshots is not None and policy is None:
            raise ValueError("a prefix cache needs a cache policy")
        self.block_size = block_size
        self.block_hash = block_hash
        self.block_pool = block_pool
        self.state_slots = state_slots
        self.snapshots = snapshots
        self.policy = policy
        self.prefix_cache: PrefixCache | None = None
        if snapshots is not None and policy is not None:
            policy.bind(block_pool, snapshots)
            block_pool.on_evict = self._on_block_evicted
            self.prefix_cache = PrefixCache(block_pool, snapshots, block_size)
        self._sequences: dict[int, _SequenceCache] = {}

    @classmethod
    def create(cls, block_size: int, num_blocks: int, num_state_slots: int, num_snapshot_slots: int,
               policy: CachePolicy | None, block_hash: str = "xxh3_128") -> JointCacheManager:
        """A manager with pools of these sizes; no snapshot slots disables the prefix cache."""
        snapshots = SnapshotPool(num_snapshot_slots) if num_snapshot_slots else None
        return cls(block_size, BlockPool(num_blocks), StateSlotPool(num_state_slots), snapshots,
                   policy if snapshots is not None else None, block_hash)

    @property
    def enabled(self) -> bool:
        """Whether prefixes are cached (lookups and captures happen)."""
        return self.prefix_cache is not None

    def _entry(self, seq: CacheSequence) -> _SequenceCache:
        entry = self._sequences.get(id(seq))
        if entry is None:
            entry = self._sequences[id(seq)] = _SequenceCache(seq)
        return entry

    def block_table(self, seq: CacheSequence) -> list[int]:
        """The sequence's KV blocks in token order (the live list: copy it to keep it)."""
        entry = self._sequences.get(id(seq))
        return entry.block_ids if entry is not None else []

    def state_slot(self, seq: CacheSequence) -> int:
        """The live GDN state slot of a running sequence."""
        entry = self._sequences.get(id(seq))
        if entry is None or entry.state_slot is None:
            raise KeyError("the sequence holds no live state slot")
        return entry.state_slot

    def holds_resources(self, seq: CacheSequence) -> bool:
        """Whether the sequence holds any block or live slot."""
        entry = self._sequences.get(id(seq))
        return entry is not None and (bool(entry.block_ids) or entry.state_slot is not None)

    def forget(self, seq: CacheSequence) -> None:
        """Drop the record of a sequence that holds nothing and will not return."""
        if self.holds_resources(seq):
            raise RuntimeError("forget() on a sequence that still holds cache resources")
        self._sequences.pop(id(seq), None)

    def _extra_keys(self, seq: CacheSequence) -> tuple[object, ...]:
        """Hash extra keys: sequences with different salts share no cache entry."""
        return () if seq.cache_salt is None else (seq.cache_salt,)

    def block_hashes(self, seq: CacheSequence, num_blocks: int) -> list[BlockHash]:
        """Hashes of the sequence's first `num_blocks` full blocks (incremental for a tracked one)."""
        entry = self._sequences.get(id(seq))
        known = entry.hashes if entry is not None else []
        if num_blocks > len(known):
            upto = seq.token_ids[: num_blocks * self.block_size]
            known = block_hashes_for(upto, self.block_size, self._extra_keys(seq), start=known,
                                     algorithm=self.block_hash)
            if entry is not None:
                entry.hashes = known
        return known[:num_blocks]

    def boundary_key(self, seq: CacheSequence, num_tokens: int) -> BlockHash:
        """Name of the prefix `token_ids[:num_tokens]`: its last full block's hash, or the tail hash
        when the boundary falls inside a block."""
        full, partial = divmod(num_tokens, self.block_size)
        hashes = self.block_hashes(seq, full)
        if partial == 0:
            return hashes[-1]
        parent = hashes[-1] if hashes else None
        return hash_tail(parent, seq.token_ids[full * self.block_size:num_tokens], self._extra_keys(seq),
                         self.block_hash)

    def admit(self, seq: CacheSequence) -> Restore | None:
        """Joint lookup, then attach and allocate what the sequence needs to run from the hit; None
        (nothing taken) when a live slot or the blocks are not free now. All or nothing."""
        if self.state_slots.num_free_slots == 0:
            return None
        entry = self._entry(seq)  # a waiting sequence's record keeps its hashes across retries
        lookup = self._lookup(seq)
        hit = lookup.hit if lookup is not None else PrefixHit(0, [], None)
        num_hit_blocks = len(hit.block_ids)
        held = hit.block_ids + ([hit.tail_block] if hit.tail_block is not None else [])
        new_needed = blocks_for(seq.num_tokens, self.block_size) - num_hit_blocks
        revived = sum(1 for b in held if self.block_pool.ref_count(b) == 0)
        if new_needed + revived > self.block_pool.num_free_blocks:
            return None
        self.block_pool.touch(held)
        entry.block_ids = list(hit.block_ids)
        try:
            entry.block_ids += self.block_pool.allocate(new_needed)
            entry.state_slot = self.state_slots.allocate()
            if hit.snapshot_slot is not None:
                self._snapshot_pool().pin(hit.snapshot_slot)
        except Exception:
            self.release(seq)
            self.block_pool.free(held[num_hit_blocks:])
            raise
        entry.num_registered_blocks = num_hit_blocks
        kv_copy = None
        if lookup is not None:
            entry.branch_point = lookup.kv_match_tokens if lookup.kv_match_tokens > hit.num_tokens else 0
            entry.snapshot_depth, entry.snapshot_key = hit.num_tokens, lookup.key
            if hit.tail_block is not None:
                kv_copy = (hit.tail_block, entry.block_ids[num_hit_blocks])
        return Restore(seq, entry.state_slot, hit.snapshot_slot, hit.num_tokens, kv_copy, lookup)

    def _lookup(self, seq: CacheSequence) -> PrefixLookup | None:
        if self.prefix_cache is None:
            return None
        hashes = self.block_hashes(seq, seq.num_tokens // self.block_size)
        lookup = self.prefix_cache.lookup(hashes, seq.token_ids, self._extra_keys(seq), self.block_hash)
        slot = lookup.hit.snapshot_slot
        if slot is not None:
            # The snapshot must describe exactly this prefix before anyone restores it.
            snapshots = self._snapshot_pool()
            if snapshots.key_of(slot) != lookup.key or snapshots.num_tokens_of(slot) != lookup.hit.num_tokens:
                raise RuntimeError(f"snapshot slot {slot} does not hold the prefix its key names")
        return lookup

    def grow(self, seq: CacheSequence, num_tokens: int) -> list[int] | None:
        """New blocks so the sequence covers `num_tokens`, or None (nothing taken) when the pool
        cannot supply them now (the caller may preempt and retry)."""
        entry = self._entry(seq)
        needed = blocks_for(num_tokens, self.block_size) - len(entry.block_ids)
        if needed <= 0:
            return []
        if not self.block_pool.can_allocate(needed):
            return None
        new_blocks = self.block_pool.allocate(needed)
        entry.block_ids.extend(new_blocks)
        return new_blocks

    def reserve_captures(self, seq: CacheSequence, start: int, length: int, captures: list[Reservation]) -> None:
        """Reserve snapshot slots for the boundaries the policy wants from the forward of tokens
        [start, start + length), appended to `captures` as taken (so `revert_chunk` finds each)."""
        if self.snapshots is None or self.policy is None:
            return
        entry = self._entry(seq)
        view = self._view(seq, entry)
        for boundary in self.policy.captures(view, start, length):
            key = self.boundary_key(seq, boundary)
            reservation = self.snapshots.reserve(key, boundary, self._parent_key(entry, boundary),
                                                 self.policy.is_opportunistic(view, boundary),
                                                 branch=boundary == entry.branch_point)
            if reservation.status is ReserveStatus.RESERVED:
                captures.append(reservation)
            if reservation.status is not ReserveStatus.SKIPPED:
                entry.snapshot_depth, entry.snapshot_key = boundary, key

    @staticmethod
    def _view(seq: CacheSequence, entry: _SequenceCache) -> RequestView:
        return RequestView(seq.num_prompt_tokens, seq.num_tokens, entry.branch_point, entry.snapshot_depth)

    @staticmethod
    def _parent_key(entry: _SequenceCache, boundary: int) -> BlockHash | None:
        """The snapshot on the sequence's path just below `boundary`, if known."""
        return entry.snapshot_key if 0 < entry.snapshot_depth < boundary else None

    def _on_block_evicted(self, block_hash: BlockHash) -> None:
        """A cached KV block was reclaimed: a snapshot keyed by the prefix it ends is now useless."""
        if self.snapshots is not None:
            self.snapshots.evict(block_hash)

    def commit_restore(self, restore: Restore) -> None:
        """The step that restored this admission succeeded: drop its holds, count its lookup."""
        self.drop_restore_holds(restore)
        entry = self._entry(restore.request)
        if restore.lookup is not None and not entry.lookup_counted and self.prefix_cache is not None:
            entry.lookup_counted = True  # once per sequence, across reverts and preemptions
            self.prefix_cache.record(restore.lookup)

    def commit_chunk(self, seq: CacheSequence, captures: Sequence[Reservation], failed_slots: set[int]) -> None:
        """The chunk's forward succeeded (`num_computed_tokens` includes it): register its full
        blocks, publish its captures (abort those whose copy failed)."""
        self._register_full_blocks(seq)
        for reservation in captures:
            if reservation.slot in failed_slots:
                self._snapshot_pool().abort(reservation)
            else:
                self._snapshot_pool().publish(reservation)

    def revert_restore(self, restore: Restore) -> None:
        """Undo an admission whose step failed: drop its holds and release what it took."""
        self.drop_restore_holds(restore)
        self.release(restore.request)

    def revert_chunk(self, seq: CacheSequence, new_blocks: Sequence[int], captures: Sequence[Reservation]) -> None:
        """Undo a running sequence's chunk: abort its reservations and give back its new blocks."""
        self.abort_open(captures)
        if new_blocks:
            entry = self._entry(seq)
            del entry.block_ids[-len(new_blocks):]
            self.block_pool.free(list(reversed(new_blocks)))

    def abort_open(self, captures: Sequence[Reservation]) -> None:
        """Abort the reservations among `captures` that are still open."""
        for reservation in captures:
            if self.snapshots is not None and self.snapshots.is_reserved(reservation):
                self.snapshots.abort(reservation)

    def drop_restore_holds(self, restore: Restore) -> None:
        """Unpin the restored snapshot and drop the reference on a copied partial block."""
        if restore.snapshot_slot is not None:
            self._snapshot_pool().unpin(restore.snapshot_slot)
        if restore.kv_copy is not None:
            self.block_pool.free([restore.kv_copy[0]])

    def _register_full_blocks(self, seq: CacheSequence) -> None:
        if self.prefix_cache is None:
            return
        entry = self._entry(seq)
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= entry.num_registered_blocks:
            return
        hashes = self.block_hashes(seq, num_full)
        for index in range(entry.num_registered_blocks, num_full):
            self.block_pool.register(entry.block_ids[index], hashes[index])
        entry.num_registered_blocks = num_full

    def fork(self, parent: CacheSequence, child: CacheSequence) -> Fork | None:
        """Place `child` (same tokens as a fully computed `parent`) on the parent's state: full
        blocks shared, the partial last one copied. None (nothing taken) when no slot or block is free."""
        source = self._entry(parent)
        if source.state_slot is None or parent.num_computed_tokens != parent.num_tokens:
            raise ValueError("fork() needs a running parent whose tokens are all computed")
        num_full = parent.num_computed_tokens // self.block_size
        partial = len(source.block_ids) > num_full
        if self.state_slots.num_free_slots == 0 or (partial and not self.block_pool.can_allocate(1)):
            return None
        entry = self._entry(child)
        shared = source.block_ids[:num_full]
        self.block_pool.touch(shared)
        copied = self.block_pool.allocate(1) if partial else []
        entry.block_ids = list(shared) + copied
        entry.num_registered_blocks = min(source.num_registered_blocks, num_full)
        entry.state_slot = self.state_slots.allocate()
        return Fork(source.state_slot, entry.state_slot, source.block_ids[num_full] if partial else None,
                    copied[0] if partial else None)

    def finish(self, seq: CacheSequence, keep_end_state: bool) -> EndCapture | None:
        """A running sequence ended: with `keep_end_state`, reserve a snapshot of its final state if
        the policy keeps request ends (the capture owns the live slot), then release (even on error)."""
        capture = None
        try:
            if keep_end_state:
                capture = self._reserve_end_capture(seq)
        finally:
            self.release(seq, finished=True)
        return capture

    def _reserve_end_capture(self, seq: CacheSequence) -> EndCapture | None:
        """Reserve a snapshot after the last computed token, registering a partial last block under
        its tail hash so the boundary is a joint one."""
        end = seq.num_computed_tokens
        if self.snapshots is None or self.policy is None or not self.policy.capture_at_end or end == 0:
            return None
        entry = self._entry(seq)
        full, partial = divmod(end, self.block_size)
        key = self.boundary_key(seq, end)
        if partial:
            parent = self.block_hashes(seq, full)[-1] if full else None
            self.block_pool.register_tail(entry.block_ids[full], key, parent, partial)
        reservation = self.snapshots.reserve(key, end, self._parent_key(entry, end))
        if reservation.status is not ReserveStatus.RESERVED:
            if reservation.status is ReserveStatus.DUPLICATE:
                entry.snapshot_depth, entry.snapshot_key = end, key
            return None
        if entry.state_slot is None:
            self.snapshots.abort(reservation)
            return None
        capture = EndCapture(reservation, entry.state_slot)
        entry.snapshot_depth, entry.snapshot_key = end, key
        entry.state_slot = None  # the capture owns the live slot now
        return capture

    def complete_end_capture(self, capture: EndCapture, copied: bool) -> None:
        """Publish the end snapshot if its copy succeeded (else abort it), and free the live slot."""
        try:
            if copied:
                self._snapshot_pool().publish(capture.reservation)
            else:
                self._snapshot_pool().abort(capture.reservation)
        finally:
            self.state_slots.free(capture.state_slot)

    def release(self, seq: CacheSequence, finished: bool = False) -> None:
        """Give back blocks (tail first, so shared prefixes stay cached longest) and the live slot; a
        finished sequence's blocks the policy judges worthless go to the free list's front."""
        entry = self._entry(seq)
        blocks = entry.block_ids
        cold_from = len(blocks)
        if finished and self.policy is not None:
            position = self.policy.evict_kv_first(self._view(seq, entry))
            if position is not None:
                cold_from = min(cold_from, blocks_for(position, self.block_size))
        entry.block_ids = []
        entry.num_registered_blocks = 0
        slot, entry.state_slot = entry.state_slot, None
        if cold_from < len(blocks):
            self.block_pool.free(list(reversed(blocks[cold_from:])), evict_first=True)
        self.block_pool.free(list(reversed(blocks[:cold_from])))
        if slot is not None:
            self.state_slots.free(slot)
        if finished:
            self._sequences.pop(id(seq), None)

    def _snapshot_pool(self) -> SnapshotPool:
        if self.snapshots is None:
            raise RuntimeError("the prefix cache is disabled")
        return self.snapshots

    def usage(self) -> CacheUsage:
        """Pool capacities and occupancy."""
        pool, slots, snaps = self.block_pool, self.state_slots, self.snapshots
        return CacheUsage(pool.num_blocks, pool.num_used_blocks, pool.num_free_blocks, pool.num_cached_free_blocks,
                          slots.num_slots, slots.num_free_slots, snaps.num_reserved if snaps else 0,
                          snaps.num_pinned if snaps else 0)

    def prefix_stats(self) -> PrefixCacheStats:
        """Lookup counters since start-up (zeros when the prefix cache is off)."""
        return self.prefix_cache.stats() if self.prefix_cache is not None else PrefixCacheStats(0, 0, 0, 0, 0, 0)

    def snapshot_stats(self) -> SnapshotPoolStats:
        """Snapshot pool counters (zeros when the prefix cache is off)."""
        if self.snapshots is None:
            return SnapshotPoolStats(0, 0, 0, 0, 0, 0, 0, 0, 0)
        return self.snapshots.stats()

    def check_integrity(self, running: Sequence[CacheSequence], waiting: Sequence[CacheSequence]) -> None:
        """Pools consistent, every block and live-slot reference held by exactly the `running`
        sequences, `waiting` ones holding nothing; AssertionError names the first breach."""
        self.block_pool.check_integrity()
        self.state_slots.check_integrity()
        if self.snapshots is not None:
            self.snapshots.check_integrity()
        held: dict[int, int] = {}
        for seq in running:
            entry = self._sequences.get(id(seq))
            assert entry is not None and entry.state_slot is not None, "a running sequence has no state slot"
            for block in entry.block_ids:
                held[block] = held.get(block, 0) + 1
        for block, count in held.items():
            assert self.block_pool.ref_count(block) == count, f"block {block}: refcount mismatch"
        assert self.block_pool.num_used_blocks == len(held), "a used block has no owner"
        assert self.state_slots.num_free_slots == self.state_slots.num_slots - len(running), "state slot leak"
        for seq in waiting:
            assert not self.holds_resources(seq), "a waiting sequence holds cache resources"
        live = {id(seq) for seq in running} | {id(seq) for seq in waiting}
        assert all(key in live for key in self._sequences), "a record outlived its sequence (finish or forget it)"

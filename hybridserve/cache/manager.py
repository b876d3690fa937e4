"""`JointCacheManager`, the scheduler's only door to cache state (tensor-free: the engine and the
trace simulator drive the same object). It owns the pools, the joint lookup and the policy, and
keeps each sequence's cache bookkeeping; docs/prefix-cache.md walks through its verbs. Lower tiers
(`TieredCache`: host memory, disk) plug in here without touching the scheduler: a device snapshot is
demoted when it is evicted (`_on_snapshot_evicted`, from the policy's victims and `_on_block_evicted`),
an admission whose deepest hit lies in a lower tier waits (admit returns None, as when blocks are short)
while it is promoted into the device pools, and its `Restore` names the tier and the objects loaded.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from hybridserve.cache.block_pool import BlockHash, BlockPool, HashAlgorithm, block_hashes_for, hash_tail
from hybridserve.cache.policy import CachePolicy, RequestView
from hybridserve.cache.prefix_cache import PrefixCache, PrefixCacheStats, PrefixHit, PrefixLookup
from hybridserve.cache.snapshots import Reservation, ReserveStatus, SnapshotPool, SnapshotPoolStats
from hybridserve.cache.state_slots import StateSlotPool
from hybridserve.cache.tiers import (
    DEVICE,
    KV,
    STATE,
    DiscoveryQuery,
    JointEntry,
    TieredCache,
    TierHit,
    TierObject,
    TierStats,
)
from hybridserve.routing.summary import JointBoundary


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

    @property
    def skips_prefix_cache(self) -> bool:
        """Whether it must compute its whole prompt (e.g. for prompt logprobs): no hit is taken."""
        ...


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
    tier: str = DEVICE                    # where the hit's state came from (promoted before admission)
    loaded: tuple[TierObject, ...] = ()   # the objects promoted from that tier for this admission


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
    resumes: bool = False                      # ... where an earlier request's cached end tail continues
    snapshot_depth: int = 0                    # deepest snapshot on its path (restored or taken)
    snapshot_key: BlockHash | None = None      # ... and its key (the parent of the next one taken)
    lookup_counted: bool = False               # its admission is in the prefix-cache stats
    hashes: list[BlockHash] = field(default_factory=list)  # full-block hashes computed so far
    remote_lookup: int | None = None           # its discovery lookup in the shared tier, in flight
    remote_looked_up: bool = False             # ... done once per sequence


@dataclass(eq=False)
class _Promotion:
    """A joint entry on its way from a lower tier into the device pools. It holds a snapshot
    reservation (then, once published, a pin) and a reference on every KV block of the prefix (device
    hits and load targets), until its owner's admission takes its own, or, with no owner left, until
    it completes."""

    ticket: int
    owner: CacheSequence | None
    hit: TierHit
    reservation: Reservation
    blocks: list[int]                 # device blocks of the prefix, in order (held)
    num_cached: int                   # of which already on the device; the rest are load targets
    objects: tuple[TierObject, ...]
    done: bool = False


class JointCacheManager:
    """Owns the pools, the joint lookup and the policy. `snapshots is None` disables the prefix
    cache; blocks and live slots are still managed."""

    def __init__(self, block_size: int, block_pool: BlockPool, state_slots: StateSlotPool,
                 snapshots: SnapshotPool | None, policy: CachePolicy | None = None,
                 block_hash: HashAlgorithm = "xxh3_128", tiers: TieredCache | None = None) -> None:
        if snapshots is not None and policy is None:
            raise ValueError("a prefix cache needs a cache policy")
        if tiers is not None and snapshots is None:
            raise ValueError("lower cache tiers need the prefix cache (snapshot slots)")
        self.block_size = block_size
        self.block_hash = block_hash
        self.block_pool = block_pool
        self.state_slots = state_slots
        self.snapshots = snapshots
        self.policy = policy
        self.prefix_cache: PrefixCache | None = None
        # The prefix of each published (and reserved) device snapshot: to demote it whole (tiers), and
        # to tell which snapshots are joint hits now (`joint_boundaries`).
        self._paths: dict[BlockHash, JointEntry] = {}
        self._reserved_paths: dict[BlockHash, JointEntry] = {}
        self._kinds: dict[BlockHash, str] = {}  # candidate kind of each of those (the policy and tiers learn by it)
        if snapshots is not None and policy is not None:
            policy.bind(block_pool, snapshots, self._kinds)
            block_pool.on_evict = self._on_block_evicted
            self.prefix_cache = PrefixCache(block_pool, snapshots, block_size)
        self._sequences: dict[int, _SequenceCache] = {}
        self.tiers = tiers
        self._promotions: dict[int, _Promotion] = {}    # by ticket
        self._promotion_of: dict[int, int] = {}         # id(owner) -> ticket
        self._discarded: dict[int, bool] = {}           # ticket in flight at a reset -> drop its tier entry too
        self.device_hits = self.device_hit_tokens = 0
        if snapshots is not None:
            snapshots.on_evict = self._on_snapshot_evicted

    @classmethod
    def create(cls, block_size: int, num_blocks: int, num_state_slots: int, num_snapshot_slots: int,
               policy: CachePolicy | None, block_hash: HashAlgorithm = "xxh3_128") -> JointCacheManager:
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
        self._detach_promotion(seq)
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
        # A sequence that must compute its whole prompt (e.g. for prompt logprobs) takes no hit;
        # what it computes is registered and published as any cold start's.
        bypass = seq.skips_prefix_cache
        promotion = None
        if self.tiers is not None and not bypass:
            promotion, waiting = self._promote_for(seq)
            if waiting:
                return None  # its restore is on its way from a lower tier; the others run
        lookup = None if bypass else self._lookup(seq)
        hit = lookup.hit if lookup is not None else PrefixHit(0, [], None)
        if lookup is not None and self.policy is not None and self.policy.learns_from_paths:
            self.policy.observe_missed_path(self._boundaries_beyond(seq, hit.num_tokens, lookup.kv_match_tokens))
        num_hit_blocks = len(hit.block_ids)
        held = hit.block_ids + ([hit.tail_block] if hit.tail_block is not None else [])
        new_needed = blocks_for(seq.num_tokens, self.block_size) - num_hit_blocks
        revived = sum(1 for b in held if self.block_pool.ref_count(b) == 0)
        if new_needed + revived > self.block_pool.num_free_blocks:
            return None
        self.block_pool.touch(held)
        entry.block_ids = list(hit.block_ids)
        try:
            entry.block_ids += self._allocate_blocks(new_needed)
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
            tail_key = self._resumed_tail(seq, entry.branch_point) if entry.branch_point > 0 else None
            entry.resumes = tail_key is not None
            if tail_key is not None and self.policy is not None:
                self.policy.observe_missed_end(tail_key)
            entry.snapshot_depth, entry.snapshot_key = hit.num_tokens, lookup.key
            if hit.tail_block is not None:
                kv_copy = (hit.tail_block, entry.block_ids[num_hit_blocks])
        if promotion is None:
            return Restore(seq, entry.state_slot, hit.snapshot_slot, hit.num_tokens, kv_copy, lookup)
        self._drop_promotion(promotion)  # the admission holds what it restores now
        if lookup is None or lookup.key != promotion.hit.entry.key:
            return Restore(seq, entry.state_slot, hit.snapshot_slot, hit.num_tokens, kv_copy, lookup)
        return Restore(seq, entry.state_slot, hit.snapshot_slot, hit.num_tokens, kv_copy, lookup,
                       promotion.hit.tier, promotion.objects)

    # -- lower tiers ----------------------------------------------------------------------
    def poll_tiers(self) -> None:
        """Settle the transfers the tier mover finished (the engine calls this once per step;
        `admit` also does)."""
        if self.tiers is None:
            return
        for ticket, ok in self.tiers.poll():
            self._complete_promotion(ticket, ok)

    def _promote_for(self, seq: CacheSequence) -> tuple[_Promotion | None, bool]:
        """(its completed promotion, whether it must wait): start promoting the deepest lower-tier hit
        deeper than the device's; wait while it, or another request's promotion of it, is in flight."""
        self.poll_tiers()
        ticket = self._promotion_of.get(id(seq))
        if ticket is not None:
            current = self._promotions[ticket]
            return (current, False) if current.done else (None, True)
        lookup = self._lookup(seq)
        depth = lookup.hit.num_tokens if lookup is not None else 0
        hit = self._tier_lookup(seq, depth)
        if self._discover(seq, hit.entry.num_tokens if hit is not None else depth):
            return None, True  # the shared store may hold more than this replica: wait for its answer
        if hit is None:
            return None, False
        if any(p.hit.entry.key == hit.entry.key for p in self._promotions.values()):
            return None, True
        promotion = self._start_promotion(seq, hit)
        if promotion is None:
            return None, False  # no room on the device now: restore what the device has
        self.poll_tiers()
        return (promotion, False) if promotion.done else (None, True)

    def _tier_lookup(self, seq: CacheSequence, deeper_than: int) -> TierHit | None:
        """The deepest lower-tier entry on the sequence's path deeper than `deeper_than` tokens."""
        assert self.tiers is not None
        size = self.block_size
        hashes = self.block_hashes(seq, seq.num_tokens // size)
        extra = self._extra_keys(seq)

        def tail_key(blocks: int, length: int) -> BlockHash:
            parent = hashes[blocks - 1] if blocks else None
            return hash_tail(parent, seq.token_ids[blocks * size:blocks * size + length], extra, self.block_hash)

        return self.tiers.lookup(hashes, seq.num_tokens - 1, deeper_than, size, tail_key)

    def _discover(self, seq: CacheSequence, deeper_than: int) -> bool:
        """Whether `seq` must wait for a discovery lookup in the shared tier's store (entries other
        replicas wrote): started once per sequence when its hit is at least a block short of its
        prompt; a found entry lands in the shared tier's books, and the next admit promotes it."""
        assert self.tiers is not None
        entry = self._entry(seq)
        if entry.remote_lookup is not None and self.tiers.discovering(entry.remote_lookup):
            return True
        entry.remote_lookup = None
        limit = seq.num_tokens - 1
        if entry.remote_looked_up or self.tiers.discovery is None or limit - deeper_than < self.block_size:
            return False
        entry.remote_looked_up = True
        size, extra, algorithm = self.block_size, self._extra_keys(seq), self.block_hash
        hashes = tuple(self.block_hashes(seq, seq.num_tokens // size))
        tokens = tuple(seq.token_ids[:limit])  # a copy: the lookup hashes tails on the store's thread

        def tail_key(blocks: int, length: int) -> BlockHash:
            parent = hashes[blocks - 1] if blocks else None
            return hash_tail(parent, tokens[blocks * size:blocks * size + length], extra, algorithm)

        entry.remote_lookup = self.tiers.discover(DiscoveryQuery(hashes, limit, deeper_than, size, tail_key))
        return entry.remote_lookup is not None

    def _start_promotion(self, seq: CacheSequence, hit: TierHit) -> _Promotion | None:
        """Reserve a snapshot slot and the KV blocks the device lacks for `hit`, hold the device's
        part of the prefix, and start the copy; None (nothing taken) when the device cannot make room
        for the whole admission now."""
        assert self.tiers is not None
        self.tiers.hold(hit)
        try:
            return self._reserve_promotion(seq, hit)
        finally:
            self.tiers.hold(hit, held=False)

    def _reserve_promotion(self, seq: CacheSequence, hit: TierHit) -> _Promotion | None:
        assert self.tiers is not None
        pool, joint = self._snapshot_pool(), hit.entry
        full = len(joint.blocks) - (1 if joint.tail_tokens else 0)
        cached = self.block_pool.longest_cached_prefix(joint.blocks[:full])
        revived = sum(1 for b in cached if self.block_pool.ref_count(b) == 0)
        admission = blocks_for(seq.num_tokens, self.block_size) - len(cached)
        if admission + revived > self.block_pool.num_free_blocks:
            return None
        if pool.lookup(joint.key) is not None:  # published here without its KV: the tier's copy replaces it
            if not pool.evict(joint.key):
                return None
            self._paths.pop(joint.key, None)
            self._kinds.pop(joint.key, None)
        reservation = self._reserve_snapshot(joint.key, joint.num_tokens)
        if reservation.status is not ReserveStatus.RESERVED:
            return None
        self._reserved_paths[joint.key] = joint
        self._kinds[joint.key] = self.tiers.kind_of(hit)
        self.block_pool.touch(cached)
        targets = self._allocate_blocks(len(joint.blocks) - len(cached))  # may demote device snapshots
        assert reservation.slot is not None
        ticket = self.tiers.promote(hit, reservation.slot, list(zip(joint.blocks[len(cached):], targets)))
        objects = self.tiers.promotion_objects(ticket)
        promotion = _Promotion(ticket, seq, hit, reservation, cached + targets, len(cached), objects)
        self._promotions[ticket] = promotion
        self._promotion_of[id(seq)] = ticket
        return promotion

    def _complete_promotion(self, ticket: int, ok: bool) -> None:
        """Publish a promoted entry (register its loaded KV blocks), or undo a failed one."""
        assert self.tiers is not None
        promotion = self._promotions[ticket]
        joint = self.tiers.complete_promotion(ticket, ok)
        discarded = self._discarded.pop(ticket, None)
        if not ok or discarded is not None:
            self._drop_promotion(promotion)
            if discarded:
                self.tiers.forget(joint.key)
            return
        for index in range(promotion.num_cached, len(joint.blocks)):
            block, key = promotion.blocks[index], joint.blocks[index]
            if joint.tail_tokens and index == len(joint.blocks) - 1:
                self.block_pool.register_tail(block, key, joint.parent, joint.tail_tokens)
            else:
                self.block_pool.register(block, key)
        self._publish(promotion.reservation)
        assert promotion.reservation.slot is not None
        self._snapshot_pool().pin(promotion.reservation.slot)
        promotion.done = True
        if promotion.owner is None:
            self._drop_promotion(promotion)

    def _drop_promotion(self, promotion: _Promotion) -> None:
        """Give back what a completed (or failed) promotion holds and forget it."""
        if promotion.done:
            assert promotion.reservation.slot is not None
            self._snapshot_pool().unpin(promotion.reservation.slot)
        else:
            self._abort(promotion.reservation)
        self.block_pool.free(list(reversed(promotion.blocks)))
        del self._promotions[promotion.ticket]
        if promotion.owner is not None:
            self._promotion_of.pop(id(promotion.owner), None)

    def _detach_promotion(self, seq: CacheSequence) -> None:
        """A waiting sequence goes away: its completed promotion's holds go, one in flight finishes
        ownerless (its copies target blocks and a slot that must stay reserved until then)."""
        ticket = self._promotion_of.pop(id(seq), None)
        if ticket is None:
            return
        promotion = self._promotions[ticket]
        promotion.owner = None
        if promotion.done:
            self._drop_promotion(promotion)

    def _joint_entry(self, seq: CacheSequence, boundary: int, key: BlockHash) -> JointEntry:
        """The joint entry of the sequence's state at `boundary`: its prefix's KV objects by hash."""
        full, partial = divmod(boundary, self.block_size)
        blocks = tuple(self.block_hashes(seq, full)) + ((key,) if partial else ())
        return JointEntry(key, boundary, blocks, partial)

    def _note_reserved(self, seq: CacheSequence, reservation: Reservation, kind: str) -> None:
        if reservation.status is ReserveStatus.RESERVED:
            self._reserved_paths[reservation.key] = self._joint_entry(seq, reservation.num_tokens, reservation.key)
            self._kinds[reservation.key] = kind

    def _publish(self, reservation: Reservation) -> None:
        """Publish a reserved snapshot and note its prefix (with tiers, copy it down in write-through)."""
        self._snapshot_pool().publish(reservation)
        if self.policy is not None:
            self.policy.observe_publish(self._kinds.get(reservation.key), reservation.key)
        joint = self._reserved_paths.pop(reservation.key)
        self._paths[reservation.key] = joint
        if self.tiers is None:
            return
        # write-through, and to a shared tier
        self.tiers.publish(joint, reservation.slot, self.block_pool.lookup, self._kinds.get(reservation.key))

    def _abort(self, reservation: Reservation) -> None:
        self._snapshot_pool().abort(reservation)
        if reservation.status is ReserveStatus.RESERVED:
            self._reserved_paths.pop(reservation.key, None)
            self._kinds.pop(reservation.key, None)

    def _on_snapshot_evicted(self, key: BlockHash, slot: int) -> None:
        """A device snapshot was evicted (its slot may be reused by the next forward): copy it and
        its prefix's KV down a tier (write-back) while the device still holds them."""
        joint, kind = self._paths.pop(key, None), self._kinds.pop(key, None)
        if joint is not None and self.tiers is not None:
            self.tiers.demote(joint, slot, self.block_pool.lookup, kind=kind)

    def joint_boundaries(self) -> list[JointBoundary]:
        """Every boundary a lookup could hit now, for routing (tensor-free): each published device
        snapshot whose prefix KV blocks (its tail block included) are all present, then each ready
        entry of the lower tiers, fastest tier first."""
        out: list[JointBoundary] = []
        if self.snapshots is not None:
            for key, joint in self._paths.items():
                if self.snapshots.lookup(key) is not None and self.block_pool.holds_all(joint.blocks):
                    out.append(JointBoundary(key, joint.parent, joint.num_tokens, DEVICE))
        if self.tiers is not None:
            for tier in self.tiers.tiers:
                out += [JointBoundary(entry.key, entry.parent, entry.num_tokens, tier.name)
                        for entry in tier.entries.values() if tier.ready(entry)]
        return out

    def tier_stats(self) -> list[TierStats]:
        """Hits by tier (the device first) and each lower tier's occupancy and transfer counters."""
        device = TierStats(DEVICE, 0, 0, self.snapshots.num_published if self.snapshots else 0,
                           self.block_pool.num_cached_free_blocks, self.device_hits, self.device_hit_tokens,
                           0, 0, 0, 0, 0, 0, 0, 0, 0)
        return [device] + (self.tiers.stats() if self.tiers is not None else [])

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

    def _boundaries_beyond(self, seq: CacheSequence, depth: int, kv_match_tokens: int) -> Iterator[BlockHash]:
        """Keys of the sequence's boundaries deeper than `depth` whose KV is cached (full blocks up to
        `kv_match_tokens`, as the lookup found), deepest first."""
        if self.prefix_cache is None:
            return iter(())
        hashes = self.block_hashes(seq, seq.num_tokens // self.block_size)
        return self.prefix_cache.boundaries_beyond(hashes, seq.token_ids, self._extra_keys(seq), depth,
                                                   kv_match_tokens, self.block_hash)

    def grow(self, seq: CacheSequence, num_tokens: int) -> list[int] | None:
        """New blocks so the sequence covers `num_tokens`, or None (nothing taken) when the pool
        cannot supply them now (the caller may preempt and retry)."""
        entry = self._entry(seq)
        needed = blocks_for(num_tokens, self.block_size) - len(entry.block_ids)
        if needed <= 0:
            return []
        if not self.block_pool.can_allocate(needed):
            return None
        new_blocks = self._allocate_blocks(needed)
        entry.block_ids.extend(new_blocks)
        return new_blocks

    def _allocate_blocks(self, n: int) -> list[int]:
        """Take `n` KV blocks for writing (`BlockPool.allocate`), once no lower tier still reads them."""
        blocks = self.block_pool.allocate(n)
        if self.tiers is not None and blocks:
            self.tiers.reusing(KV, blocks)
        return blocks

    def _reserve_snapshot(self, key: BlockHash, num_tokens: int, parent: BlockHash | None = None,
                          opportunistic: bool = False, branch: bool = False) -> Reservation:
        """`SnapshotPool.reserve`; a slot it hands out is written only once no lower tier still reads it."""
        reservation = self._snapshot_pool().reserve(key, num_tokens, parent, opportunistic, branch)
        if self.tiers is not None and reservation.slot is not None:
            self.tiers.reusing(STATE, [reservation.slot])
        return reservation

    def reserve_captures(self, seq: CacheSequence, start: int, length: int, captures: list[Reservation]) -> None:
        """Reserve snapshot slots for the boundaries the policy wants from the forward of tokens
        [start, start + length), appended to `captures` as taken (so `revert_chunk` finds each)."""
        if self.snapshots is None or self.policy is None:
            return
        entry = self._entry(seq)
        view = self._view(seq, entry)
        for boundary in self.policy.captures(view, start, length):
            key = self.boundary_key(seq, boundary)
            # An opportunistic capture must not push out a snapshot that still serves; with a lower
            # tier the pushed-out snapshot is demoted and still serves (the policy weighs that).
            opportunistic = self.policy.is_opportunistic(view, boundary, demoted=self.tiers is not None)
            reservation = self._reserve_snapshot(key, boundary, self._parent_key(entry, boundary), opportunistic,
                                                 branch=self.policy.holds_as_branch(view, boundary, key))
            if reservation.status is ReserveStatus.RESERVED:
                captures.append(reservation)
                self._note_reserved(seq, reservation, self.policy.kind_of(view, boundary))
            if reservation.status is not ReserveStatus.SKIPPED:
                entry.snapshot_depth, entry.snapshot_key = boundary, key

    def _resumed_tail(self, seq: CacheSequence, boundary: int) -> BlockHash | None:
        """The key of the cached tail the block after `boundary` starts with (an earlier request ended
        there, and its end snapshot is gone): the sequence continues that request rather than
        branching off a shared prefix. None when no such tail is cached."""
        full = boundary // self.block_size
        tails = self.block_pool.tails_after(self.block_hashes(seq, full)[-1] if full else None)
        for length in sorted(set(tails.values()), reverse=True):
            key = self.boundary_key(seq, boundary + length) if boundary + length < seq.num_prompt_tokens else None
            if key is not None and key in tails:
                return key
        return None

    @staticmethod
    def _view(seq: CacheSequence, entry: _SequenceCache) -> RequestView:
        return RequestView(seq.num_prompt_tokens, seq.num_tokens, entry.branch_point, entry.snapshot_depth,
                           entry.resumes)

    @staticmethod
    def _parent_key(entry: _SequenceCache, boundary: int) -> BlockHash | None:
        """The snapshot on the sequence's path just below `boundary`, if known."""
        return entry.snapshot_key if 0 < entry.snapshot_depth < boundary else None

    def _on_block_evicted(self, block_hash: BlockHash) -> None:
        """A cached KV block is being reclaimed: a snapshot keyed by the prefix it ends is now useless
        here (with tiers, it goes down a tier with its prefix, this block included)."""
        if self.snapshots is not None:
            slot = self.snapshots.lookup(block_hash)
            if self.snapshots.evict(block_hash) and slot is not None:
                self._on_snapshot_evicted(block_hash, slot)

    def commit_restore(self, restore: Restore) -> None:
        """The step that restored this admission succeeded: drop its holds, count its lookup."""
        self.drop_restore_holds(restore)
        entry = self._entry(restore.request)
        if restore.lookup is not None and not entry.lookup_counted and self.prefix_cache is not None:
            entry.lookup_counted = True  # once per sequence, across reverts and preemptions
            key = restore.lookup.key
            if key is not None and self.policy is not None and self.snapshots is not None:
                self.policy.observe_restore(self._kinds.get(key), self.snapshots.num_hits(key), key)
            self.prefix_cache.record(restore.lookup)
            if key is not None:
                self._count_hit(restore)

    def _count_hit(self, restore: Restore) -> None:
        if restore.tier != DEVICE and self.tiers is not None:
            self.tiers.record_hit(restore.tier, restore.num_tokens)
        else:
            self.device_hits += 1
            self.device_hit_tokens += restore.num_tokens

    def commit_chunk(self, seq: CacheSequence, captures: Sequence[Reservation], failed_slots: set[int]) -> None:
        """The chunk's forward succeeded (`num_computed_tokens` includes it): register its full
        blocks, publish its captures (abort those whose copy failed)."""
        self._register_full_blocks(seq)
        for reservation in captures:
            if reservation.slot in failed_slots:
                self._abort(reservation)
            else:
                self._publish(reservation)

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
                self._abort(reservation)

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
        copied = self._allocate_blocks(1) if partial else []
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
        reservation = self._reserve_snapshot(key, end, self._parent_key(entry, end))
        if reservation.status is not ReserveStatus.RESERVED:
            if reservation.status is ReserveStatus.DUPLICATE:
                entry.snapshot_depth, entry.snapshot_key = end, key
            return None
        self._note_reserved(seq, reservation, "end")
        if entry.state_slot is None:
            self._abort(reservation)
            return None
        capture = EndCapture(reservation, entry.state_slot)
        entry.snapshot_depth, entry.snapshot_key = end, key
        entry.state_slot = None  # the capture owns the live slot now
        return capture

    def complete_end_capture(self, capture: EndCapture, copied: bool) -> None:
        """Publish the end snapshot if its copy succeeded (else abort it), and free the live slot."""
        try:
            if copied:
                self._publish(capture.reservation)
            else:
                self._abort(capture.reservation)
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

    def reset_prefix_cache(self, lower_tiers: bool = False) -> bool:
        """Forget every cached prefix: the hashes of free KV blocks, the device snapshots, the
        promotions waiting sequences hold (one still in flight is dropped when it lands), and with
        `lower_tiers` the entries of every lower tier (`TieredCache.reset`). Nothing is counted as an
        eviction or demoted, and the policy learns nothing from it. False, changing nothing, while a
        sequence holds blocks or a live slot (its prefix is in use)."""
        if any(self.holds_resources(entry.owner) for entry in self._sequences.values()):
            return False
        for promotion in list(self._promotions.values()):
            if promotion.owner is not None:
                self._promotion_of.pop(id(promotion.owner), None)
                promotion.owner = None
            if promotion.done:
                self._drop_promotion(promotion)
            else:  # a second reset before it lands keeps the first one's `lower_tiers`
                self._discarded[promotion.ticket] = self._discarded.get(promotion.ticket, False) or lower_tiers
        if self.snapshots is not None:
            self.snapshots.clear()
            for key in [key for key in self._paths if self.snapshots.lookup(key) is None]:
                del self._paths[key]
            for key in [key for key in self._kinds if key not in self._paths and key not in self._reserved_paths]:
                del self._kinds[key]  # in place: the policy reads this mapping
        self.block_pool.evict_all_cached()
        if lower_tiers and self.tiers is not None:
            self.tiers.reset()
        return True

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
            assert self._paths.keys() == set(self.snapshots.published_keys()), "device snapshot prefixes out of step"
        held: dict[int, int] = {}
        for seq in running:
            entry = self._sequences.get(id(seq))
            assert entry is not None and entry.state_slot is not None, "a running sequence has no state slot"
            for block in entry.block_ids:
                held[block] = held.get(block, 0) + 1
        if self.tiers is not None:
            self._check_tiers(waiting, held)
        for block, count in held.items():
            assert self.block_pool.ref_count(block) == count, f"block {block}: refcount mismatch"
        assert self.block_pool.num_used_blocks == len(held), "a used block has no owner"
        assert self.state_slots.num_free_slots == self.state_slots.num_slots - len(running), "state slot leak"
        for seq in waiting:
            assert not self.holds_resources(seq), "a waiting sequence holds cache resources"
        live = {id(seq) for seq in running} | {id(seq) for seq in waiting}
        assert all(key in live for key in self._sequences), "a record outlived its sequence (finish or forget it)"

    def _check_tiers(self, waiting: Sequence[CacheSequence], held: dict[int, int]) -> None:
        """Every tier's books, each device snapshot's prefix noted, and each promotion owned by a
        waiting sequence (or none), holding a live reservation or a pin; adds their blocks to `held`."""
        assert self.tiers is not None
        self.tiers.check_integrity()
        pool = self._snapshot_pool()
        assert self._paths.keys() == set(pool.published_keys()), "device snapshot prefixes out of step"
        assert self._kinds.keys() <= self._paths.keys() | self._reserved_paths.keys(), "a kind outlived its snapshot"
        assert all(self._paths[key].num_tokens == pool.num_tokens_of(slot)
                   for key in self._paths if (slot := pool.lookup(key)) is not None), "a prefix names another boundary"
        in_flight = {ticket for ticket, promotion in self._promotions.items() if not promotion.done}
        assert in_flight == set(self.tiers.pending_promotions()), "a promotion is dangling"
        assert self._discarded.keys() <= in_flight, "a discarded promotion outlived its transfer"
        assert all(self._promotions[ticket].owner is None for ticket in self._discarded), \
            "a discarded promotion has an owner"
        waiting_ids = {id(seq) for seq in waiting}
        for ticket, promotion in self._promotions.items():
            owner = promotion.owner
            assert owner is None or (id(owner) in waiting_ids and self._promotion_of.get(id(owner)) == ticket), \
                "a promotion's owner is not waiting for it"
            assert owner is not None or not promotion.done, "a completed promotion has no owner"
            slot = promotion.reservation.slot
            assert slot is not None
            if promotion.done:
                assert pool.pin_count(slot) > 0, "a completed promotion lost its pin"
            else:
                assert pool.is_reserved(promotion.reservation), "a promotion lost its reservation"
            for block in promotion.blocks:
                held[block] = held.get(block, 0) + 1
        assert len(self._promotion_of) == sum(p.owner is not None for p in self._promotions.values()), \
            "stale promotion owners"

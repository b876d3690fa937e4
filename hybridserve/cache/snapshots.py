"""GDN state snapshot slots, keyed by their boundary's block (or tail) hash; bookkeeping only (the
tensors live in the runner). `reserve` -> the caller copies the state -> `publish` or `abort`; a
slot being restored is pinned and never evicted."""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from itertools import islice
from typing import NamedTuple

from hybridserve.cache.block_pool import BlockHash, check_free_list, check_index

EvictCallback = Callable[[BlockHash, int], None]
"""Called as ``on_evict(key, slot)`` when :meth:`SnapshotPool.reserve` evicts a slot."""


class ReserveStatus(enum.Enum):
    """Outcome of :meth:`SnapshotPool.reserve`."""

    RESERVED = "reserved"
    """A slot was reserved; copy the state into it, then publish or abort."""
    DUPLICATE = "duplicate"
    """The key is already published (its LRU position is refreshed) or in flight."""
    SKIPPED = "skipped"
    """No free slot and nothing evictable: a soft miss, not an error."""


class Reservation(NamedTuple):
    """Handle returned by :meth:`SnapshotPool.reserve`: ``slot`` is set only for ``RESERVED``,
    ``evicted_key`` names the slot evicted to make room, ``ticket`` lets the pool reject stale handles."""

    status: ReserveStatus
    slot: int | None
    key: BlockHash
    num_tokens: int
    evicted_key: BlockHash | None = None
    ticket: int = 0


VictimChooser = Callable[["SnapshotPool"], "int | None"]
"""Picks the published, unpinned slot to evict (from :meth:`SnapshotPool.evictable`), or None."""


class SnapshotPoolStats(NamedTuple):
    """Snapshot of :class:`SnapshotPool` occupancy and counters."""

    slots: int
    published: int
    reserved: int
    pinned: int
    published_total: int
    evicted_total: int
    skipped_total: int
    aborted_total: int
    duplicate_total: int


class _State(enum.Enum):
    """Lifecycle state of one slot."""

    FREE = 0
    RESERVED = 1
    PUBLISHED = 2


class SnapshotPool:
    """Bounded LRU pool of ``num_slots`` snapshot slots, each free, reserved or published.

    Published, unpinned slots sit in an LRU list; a pinned slot leaves it and re-enters as most
    recently used when its last pin is dropped (being restored counts as a use).
    """

    def __init__(self, num_slots: int, on_evict: EvictCallback | None = None,
                 choose_victim: VictimChooser | None = None) -> None:
        """Create ``num_slots`` free slots; ``on_evict(key, slot)`` hears capacity evictions;
        ``choose_victim`` replaces the default least-recently-used choice."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.on_evict = on_evict
        self._state: list[_State] = [_State.FREE] * num_slots
        self._key: list[BlockHash | None] = [None] * num_slots
        self._num_tokens: list[int] = [0] * num_slots
        self._ticket: list[int] = [0] * num_slots
        self._pins: list[int] = [0] * num_slots
        self._last_use: list[int] = [0] * num_slots
        self._hits: list[int] = [0] * num_slots
        self._parent: list[BlockHash | None] = [None] * num_slots
        self._branch: list[bool] = [False] * num_slots
        self._children: dict[BlockHash, int] = {}
        # Evictable slots that one continuation already covers (one child, at most one hit).
        self._covered: OrderedDict[int, None] = OrderedDict()
        self.clock = 0
        self.choose_victim = choose_victim
        # The covered slot an opportunistic reservation takes (it is skipped when this returns None);
        # unset, the least recently used covered slot.
        self.choose_covered: VictimChooser | None = None
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_slots))
        self._reserved: dict[BlockHash, int] = {}
        self._published: dict[BlockHash, int] = {}
        # Published, unpinned slots: first = least recently used.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.num_pinned = 0  # published slots with at least one pin
        self._next_ticket = 1
        self.published_total = 0
        self.hits_total = 0  # restores from published snapshots
        self.evicted_total = 0
        self.skipped_total = 0
        self.aborted_total = 0
        self.duplicate_total = 0

    @property
    def num_free_slots(self) -> int:
        """Slots neither reserved nor published."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Published, unpinned slots (what a reservation may evict)."""
        return len(self._lru)

    @property
    def num_published(self) -> int:
        """Slots currently published (resident, matchable)."""
        return len(self._published)

    @property
    def num_reserved(self) -> int:
        """Slots reserved and not yet published or aborted."""
        return len(self._reserved)

    def published_keys(self) -> Iterable[BlockHash]:
        """Keys of the published slots."""
        return self._published.keys()

    def lookup(self, key: BlockHash) -> int | None:
        """Published slot for ``key``, else ``None`` (no LRU change)."""
        return self._published.get(key)

    def touch(self, key: BlockHash) -> None:
        """Mark ``key``'s published slot most-recently-used (no-op if absent or pinned)."""
        slot = self._published.get(key)
        if slot is not None:
            self.clock += 1
            self._last_use[slot] = self.clock
            if slot in self._lru:
                self._lru.move_to_end(slot)
            if slot in self._covered:
                self._covered.move_to_end(slot)

    def idle_ticks(self, key: BlockHash) -> int | None:
        """Pool clock ticks since ``key``'s published slot was published or last used (None if absent)."""
        slot = self._published.get(key)
        return self.clock - self._last_use[slot] if slot is not None else None

    def num_hits(self, key: BlockHash) -> int:
        """Restores recorded on ``key``'s published slot since it was published (0 if absent)."""
        slot = self._published.get(key)
        return self._hits[slot] if slot is not None else 0

    def is_covered(self, key: BlockHash) -> bool:
        """Whether `key` is published and covered (see `covered`)."""
        slot = self._published.get(key)
        return slot is not None and slot in self._covered

    def record_hit(self, key: BlockHash) -> None:
        """A request restores from ``key``: count the hit and mark it most-recently-used."""
        slot = self._published.get(key)
        if slot is not None:
            self._hits[slot] += 1
            self.hits_total += 1
            self.touch(key)
            self._update_covered(slot)

    def evictable(self) -> Iterable[int]:
        """Published, unpinned slots, least recently used first."""
        return self._lru.keys()

    def covered(self) -> Iterable[int]:
        """Evictable slots with exactly one child snapshot and at most one hit (the continuation
        that made the child): a deeper snapshot on the same path serves what they served.
        Least recently used first."""
        return self._covered.keys()

    def candidates(self, limit: int) -> Iterable[tuple[int, BlockHash, int, int, int, int, int]]:
        """What eviction weighs of the `limit` least recently used evictable slots: (slot, key, tokens,
        last use, hits, paths continuing past it, depth of the resident parent or 0)."""
        return self._describe(islice(self._lru, limit))

    def covered_candidates(self, limit: int) -> Iterable[tuple[int, BlockHash, int, int, int, int, int]]:
        """The same as `candidates`, for the `limit` least recently used covered slots."""
        return self._describe(islice(self._covered, limit))

    def _describe(self, slots: Iterable[int]) -> Iterable[tuple[int, BlockHash, int, int, int, int, int]]:
        keys, num_tokens, last_use, hits = self._key, self._num_tokens, self._last_use, self._hits
        parents, branch, children, published = self._parent, self._branch, self._children, self._published
        for slot in slots:
            key = keys[slot]
            count = children.get(key, 0)  # type: ignore[arg-type]
            paths = max(2, count + 1) if branch[slot] else count
            parent = parents[slot]
            parent_slot = published.get(parent) if parent is not None else None
            parent_tokens = num_tokens[parent_slot] if parent_slot is not None else 0
            yield slot, key, num_tokens[slot], last_use[slot], hits[slot], paths, parent_tokens  # type: ignore[misc]

    def paths(self, slot: int) -> int:
        """Paths continuing past a held slot: its child snapshots; at least two at a branch point (the
        older cached path and the request that left it)."""
        self._check_held(slot)
        return self._paths(slot)

    def key_of(self, slot: int) -> BlockHash:
        """Key of a reserved or published slot (raises for a free slot)."""
        self._check_held(slot)
        key = self._key[slot]
        assert key is not None
        return key

    def num_tokens_of(self, slot: int) -> int:
        """Token boundary of a reserved or published slot (raises for a free slot)."""
        self._check_held(slot)
        return self._num_tokens[slot]

    def pin_count(self, slot: int) -> int:
        """Number of pins on ``slot``."""
        self._check_slot(slot)
        return self._pins[slot]

    def pin(self, slot: int) -> None:
        """Pin a published slot (e.g. while it is being restored); pins nest."""
        self._check_slot(slot)
        if self._state[slot] is not _State.PUBLISHED:
            raise ValueError(f"only published slots can be pinned (slot {slot})")
        if self._pins[slot] == 0:
            del self._lru[slot]
            self._covered.pop(slot, None)
            self.num_pinned += 1
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        """Drop one pin; the last unpin makes the slot evictable again, as MRU."""
        self._check_slot(slot)
        if self._pins[slot] == 0:
            raise ValueError(f"unpin of unpinned slot {slot}")
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            self._lru[slot] = None
            self.num_pinned -= 1
            self._update_covered(slot)

    def reserve(self, key: BlockHash, num_tokens: int, parent: BlockHash | None = None,
                opportunistic: bool = False, branch: bool = False) -> Reservation:
        """Reserve a slot for the state at ``num_tokens`` tokens, keyed by ``key``.

        DUPLICATE if ``key`` is published (refreshing its LRU position) or in flight; else a free
        slot, else an evicted one (``choose_victim``'s pick, by default the least recently used;
        reported in ``evicted_key`` and to ``on_evict``), else SKIPPED. ``parent`` names the next
        shallower snapshot on the same path; an ``opportunistic`` reservation takes only a free or
        covered slot; a ``branch`` snapshot is where a request left an older cached path.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if key in self._published or key in self._reserved:
            if branch:  # an existing snapshot turns out to be a branch point
                slot = self._published.get(key, self._reserved.get(key))
                assert slot is not None
                self._branch[slot] = True
                self._update_covered(slot)
            self.touch(key)
            self.duplicate_total += 1
            return Reservation(ReserveStatus.DUPLICATE, None, key, num_tokens)
        evicted_key: BlockHash | None = None
        if self._free:
            slot, _ = self._free.popitem(last=False)
        elif (victim := self._victim(opportunistic)) is not None:
            slot = victim
            evicted_key = self._key[slot]
            self._unpublish(slot)
            del self._free[slot]
            self.evicted_total += 1
        else:
            self.skipped_total += 1
            return Reservation(ReserveStatus.SKIPPED, None, key, num_tokens)
        ticket = self._next_ticket
        self._next_ticket += 1
        self._state[slot] = _State.RESERVED
        self._key[slot] = key
        self._num_tokens[slot] = num_tokens
        self._ticket[slot] = ticket
        self._parent[slot] = parent
        self._branch[slot] = branch
        self._reserved[key] = slot
        if evicted_key is not None and self.on_evict is not None:
            self.on_evict(evicted_key, slot)
        return Reservation(ReserveStatus.RESERVED, slot, key, num_tokens, evicted_key, ticket)

    def publish(self, res: Reservation) -> None:
        """Make a reserved slot visible under its key as most recently used; ``ValueError`` for a
        handle that is not RESERVED or is stale (already published, aborted or superseded)."""
        slot = self._check_live(res, "publish")
        key = res.key
        del self._reserved[key]
        self._state[slot] = _State.PUBLISHED
        self._published[key] = slot
        self._lru[slot] = None
        self.clock += 1
        self._last_use[slot] = self.clock
        self._hits[slot] = 0
        self._update_covered(slot)  # its children may be in already (published deepest first)
        parent = self._parent[slot]
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1
            self._update_covered_key(parent)
        self.published_total += 1

    def is_reserved(self, res: Reservation) -> bool:
        """Whether ``res`` is a RESERVED handle still awaiting publish or abort."""
        if res.status is not ReserveStatus.RESERVED or res.slot is None:
            return False
        slot = res.slot
        return (self._state[slot] is _State.RESERVED and self._key[slot] == res.key
                and self._ticket[slot] == res.ticket)

    def abort(self, res: Reservation) -> None:
        """Return a reserved slot to the free list (a no-op for DUPLICATE and SKIPPED; a stale
        RESERVED handle raises)."""
        if res.status is not ReserveStatus.RESERVED:
            return
        slot = self._check_live(res, "abort")
        del self._reserved[res.key]
        self._release(slot)
        self.aborted_total += 1

    def evict(self, key: BlockHash) -> bool:
        """Drop ``key``'s published slot; ``False`` if absent or pinned."""
        slot = self._published.get(key)
        if slot is None or self._pins[slot] > 0:
            return False
        self._unpublish(slot)
        self.evicted_total += 1
        return True

    def clear(self) -> int:
        """Drop all unpinned published slots; returns how many (not counted as evictions)."""
        slots = list(self._lru)
        for slot in slots:
            self._unpublish(slot)
        return len(slots)

    def stats(self) -> SnapshotPoolStats:
        """Current occupancy and counters."""
        return SnapshotPoolStats(slots=self.num_slots, published=len(self._published),
                                 reserved=len(self._reserved), pinned=self.num_pinned,
                                 published_total=self.published_total, evicted_total=self.evicted_total,
                                 skipped_total=self.skipped_total, aborted_total=self.aborted_total,
                                 duplicate_total=self.duplicate_total)

    def check_integrity(self) -> None:
        """Verify every invariant; raises ``AssertionError`` on any inconsistency."""
        check_free_list(self._free, [state is _State.FREE for state in self._state], "snapshot slot")
        for slot, (state, key, pins) in enumerate(zip(self._state, self._key, self._pins)):
            assert pins == 0 or (pins > 0 and state is _State.PUBLISHED), f"slot {slot}: {pins} pins, {state.name}"
            if state is _State.FREE:
                assert key is None, f"free slot {slot} holds a key"
            else:
                index = self._reserved if state is _State.RESERVED else self._published
                assert key is not None and index.get(key) == slot, f"slot {slot} missing from its key index"
        held = self.num_slots - len(self._free)
        assert len(self._reserved) + len(self._published) == held, "stray key index entries"
        assert not (self._reserved.keys() & self._published.keys()), "key both reserved and published"
        unpinned = {slot for slot in self._published.values() if not self._pins[slot]}
        assert set(self._lru) == unpinned, "LRU list != published, unpinned slots"
        assert self.num_pinned == len(self._published) - len(unpinned), "pinned counter out of step"
        parents = (self._parent[slot] for slot in self._published.values())
        assert self._children == Counter(parent for parent in parents if parent is not None), "children out of step"
        covered = {slot for slot in range(self.num_slots) if self._is_covered(slot)}
        assert covered == set(self._covered), "covered list out of step"

    def _check_slot(self, slot: int) -> None:
        check_index(slot, self.num_slots, "slot")

    def _check_held(self, slot: int) -> None:
        self._check_slot(slot)
        if self._state[slot] is _State.FREE:
            raise ValueError(f"slot {slot} is free")

    def _check_live(self, res: Reservation, op: str) -> int:
        """Return the slot of a still-live RESERVED handle, else raise ``ValueError``."""
        if res.status is not ReserveStatus.RESERVED or res.slot is None:
            raise ValueError(f"cannot {op} a {res.status.name} reservation")
        self._check_slot(res.slot)
        if not self.is_reserved(res):
            raise ValueError(f"cannot {op}: reservation for slot {res.slot} is not live")
        return res.slot

    def _victim(self, opportunistic: bool = False) -> int | None:
        """The slot to evict for a new reservation, or None when nothing is evictable."""
        if opportunistic:
            if self.choose_covered is None:
                return next(iter(self._covered), None)
            slot = self.choose_covered(self)
            if slot is not None and slot not in self._covered:
                raise ValueError(f"eviction policy chose slot {slot}, which is not covered")
            return slot
        if not self._lru:
            return None
        if self.choose_victim is None:
            return next(iter(self._lru))
        slot = self.choose_victim(self)
        if slot is not None and slot not in self._lru:
            raise ValueError(f"eviction policy chose slot {slot}, which is not evictable")
        return slot

    def _is_covered(self, slot: int) -> bool:
        key = self._key[slot]
        return (self._state[slot] is _State.PUBLISHED and self._pins[slot] == 0 and self._hits[slot] <= 1
                and key is not None and self._paths(slot) == 1)

    def _paths(self, slot: int) -> int:
        children = self._children.get(self._key[slot], 0)  # type: ignore[arg-type]
        return max(2, children + 1) if self._branch[slot] else children

    def _update_covered(self, slot: int) -> None:
        if self._is_covered(slot):
            if slot not in self._covered:
                self._covered[slot] = None
        else:
            self._covered.pop(slot, None)

    def _update_covered_key(self, key: BlockHash) -> None:
        slot = self._published.get(key)
        if slot is not None:
            self._update_covered(slot)

    def _unpublish(self, slot: int) -> None:
        key = self._key[slot]
        assert key is not None and self._pins[slot] == 0
        parent = self._parent[slot]
        if parent is not None:
            remaining = self._children[parent] - 1
            if remaining:
                self._children[parent] = remaining
            else:
                del self._children[parent]
        del self._published[key]
        del self._lru[slot]
        self._covered.pop(slot, None)
        if parent is not None:
            self._update_covered_key(parent)
        self._release(slot)

    def _release(self, slot: int) -> None:
        self._state[slot] = _State.FREE
        self._key[slot] = None
        self._num_tokens[slot] = 0
        self._ticket[slot] = 0
        self._parent[slot] = None
        self._branch[slot] = False
        self._free[slot] = None

    def __repr__(self) -> str:
        """Short summary for debugging."""
        s = self.stats()
        return f"SnapshotPool(slots={s.slots}, published={s.published}, reserved={s.reserved}, " \
            f"pinned={s.pinned}, free={self.num_free_slots})"

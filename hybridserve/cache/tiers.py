"""Lower cache tiers (host memory, disk) behind the device pools: logical and tensor-free, so the
engine and `hybridserve sim` run the same code (docs/prefix-cache.md, Tiers).

A tier holds **joint entries**: the GDN state at a boundary (keyed like a device snapshot) and the
KV blocks of its whole prefix, each KV block stored once per tier and refcounted by the entries of
that tier. Every entry is restorable from its own tier alone, so a KV block lives in a tier only
while an entry of the same tier needs it (no dead KV). Eviction inside a tier takes the entry of
least value (`EntryValues`: GreedyDual-Frequency, with the restore rate each kind of
entry has shown in that tier as its prior) and cascades down (host -> disk -> dropped). Bytes move
through a `TierMover` the engine implements; this module only decides what moves where and keeps
the books.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from hybridserve.cache.block_pool import BlockHash

DEVICE = "device"
"""The source or destination name of the device pools (snapshot slots, KV blocks)."""
STATE = "state"
KV = "kv"
END, BLOCK_END = "end", "block"
"""Entry classes: a request end (the boundary lies inside a block), or a block boundary (interval
and prompt marks, branch points). Their restore rates differ by orders of magnitude."""
EVIDENCE_HALF_LIFE = 4096.0  # entries taken in; older restore evidence fades so rates follow the workload
PRIOR_WEIGHT = 8.0           # mean residences a depth bucket borrows from its kind, a kind from all kinds


def object_key(kind: str, key: BlockHash) -> str:
    """The physical store's key of one object: its kind and the hex of its boundary or block hash
    (which already carries the tenant salt and the hash chain)."""
    return f"{kind}-{key.hex()}"


class TierSpec(NamedTuple):
    """One lower tier: its name (e.g. "host", "disk", "remote") and byte budget. A `shared` tier (the
    last one; a store other replicas also use) gets every published entry written through, is never
    told to delete what its books let go (other replicas may need it: the store evicts on its own),
    and finds entries other replicas wrote by discovery."""

    name: str
    budget_bytes: int
    shared: bool = False


class ObjectSizes(NamedTuple):
    """Bytes of one GDN state and of one KV block (what a tier's budget counts)."""

    state_bytes: int
    kv_block_bytes: int


class JointEntry(NamedTuple):
    """The state at `num_tokens` (key `key`) and the KV objects of its prefix in token order: every
    full block's hash, then, when the boundary lies inside a block, the tail hash (equal to `key`)."""

    key: BlockHash
    num_tokens: int
    blocks: tuple[BlockHash, ...]
    tail_tokens: int  # tokens in the partial last block (0: the boundary is a block end)

    @property
    def parent(self) -> BlockHash | None:
        """The last full block before a tail (None at the root or for a block-end boundary)."""
        full = len(self.blocks) - 1 if self.tail_tokens else len(self.blocks)
        return self.blocks[full - 1] if self.tail_tokens and full else None


class TierObject(NamedTuple):
    """One object to move: `source` is DEVICE or a tier name; `device_index` is the snapshot slot (a
    state) or block id (KV) on the device, the source of a demotion or the target of a promotion."""

    kind: str
    key: str
    nbytes: int
    source: str
    device_index: int | None = None


class TierMover(Protocol):
    """What the engine implements to move bytes (tensors live there). Calls arrive in order and
    must take effect in order: a `discard` after a `start_demotion` that reads the same object from
    a tier takes effect after that read."""

    def start_demotion(self, ticket: int, tier: str, objects: Sequence[TierObject], device_kept: bool = False) -> None:
        """Copy `objects` into `tier` under their keys, each from its source (a device slot or block,
        or another tier). Device sources must be read before the next forward starts (the slot or
        block may be reused by it), unless `device_kept`: the device keeps them (a write-through
        copy of a published snapshot), unchanged until `reusing` names them; the rest may finish later."""

    def reusing(self, kind: str, indices: Sequence[int]) -> None:
        """These device snapshot slots or KV blocks (`kind`) are about to be written: finish reading
        any of them a `device_kept` demotion still reads before returning."""

    def start_promotion(self, ticket: int, objects: Sequence[TierObject]) -> None:
        """Copy each object from its source tier into the device slot or block `device_index`,
        verifying it (a corrupt or missing object fails the ticket)."""

    def discard(self, tier: str, keys: Sequence[str]) -> None:
        """Forget these objects of `tier`: no entry needs them any more (those of a failed write may
        be absent or partial)."""

    def poll(self) -> list[tuple[int, bool]]:
        """Tickets finished since the last poll, each with whether every object arrived intact."""


class DiscoveryQuery(NamedTuple):
    """A lookup in a shared tier's store for entries other replicas wrote: the deepest entry at a
    boundary in (deeper_than, limit] on a prompt's path, after `j` of its full blocks
    (`block_hashes`), at a tail of `t` tokens (key `tail_key(j, t)`) or at the end of block `j`."""

    block_hashes: tuple[BlockHash, ...]
    limit: int
    deeper_than: int
    block_size: int
    tail_key: Callable[[int, int], BlockHash]


class Discovery(Protocol):
    """What the engine implements to search a shared tier's store (asynchronously)."""

    def start_lookup(self, lookup: int, query: DiscoveryQuery) -> bool:
        """Start looking up `query`; False when it cannot start now (the caller goes on without)."""

    def poll_lookups(self) -> list[tuple[int, JointEntry | None, bool]]:
        """Lookups finished since the last poll: (lookup, the entry found or None, whether the
        store answered)."""

    def store_came_back(self) -> bool:
        """Whether the shared store returned from an outage since the last call (it may have lost
        what it held, so the books of it are forgotten)."""


class TierHit(NamedTuple):
    """A lookup's answer: the tier (highest first) holding the deepest ready entry."""

    tier: str
    entry: JointEntry


class TierStats(NamedTuple):
    """One tier's occupancy and counters."""

    name: str
    budget_bytes: int
    used_bytes: int
    entries: int
    kv_objects: int
    hits: int
    hit_tokens: int
    promotions: int
    promoted_bytes: int
    promoted_objects: int
    demotions: int
    demoted_bytes: int
    demoted_objects: int
    evictions: int
    dropped: int   # demotions refused: too large, no room, worth less than all it holds, or no source
    failed: int    # transfers the mover reported failed (a corrupt, truncated or missing object: a miss)
    lookups: int = 0     # discovery lookups (a shared tier: entries other replicas wrote)
    discovered: int = 0  # ... that found an entry, adopted into this tier's books


def entry_class(entry: JointEntry) -> str:
    """END for a boundary inside a block (only request ends fall there), else BLOCK_END."""
    return END if entry.tail_tokens else BLOCK_END


class ClassRates:
    """Restores per unit of residence, by entry label (its kind and depth bucket), exponentially
    decayed on a clock of entries taken in, so the rates follow the workload. Per unit of
    residence, not per entry: a kind the tier evicts young has had less time to be restored, and a
    per-entry rate would keep it evicted young. A depth bucket with little evidence leans on its
    kind, a kind on all kinds (0 before any restore)."""

    def __init__(self) -> None:
        self._decay = 0.5 ** (1.0 / EVIDENCE_HALF_LIFE)
        self._lambda = -math.log(self._decay)
        self._clock = 0.0
        # key -> [restored, residence, entries taken, live entries, clock of the last update]
        self._totals: dict[tuple[str, int], list[float]] = {}

    @staticmethod
    def _keys(kind: str, tokens: int) -> tuple[tuple[str, int], ...]:
        return (kind, tokens.bit_length()), (kind, -1), ("", -1)

    def _now(self, key: tuple[str, int]) -> tuple[float, float, float, list[float]]:
        """(restored, residence, taken) of `key` decayed to now, and its record."""
        record = self._totals.get(key)
        if record is None:
            record = self._totals[key] = [0.0, 0.0, 0.0, 0.0, self._clock]
        span = self._clock - record[4]
        fade = self._decay ** span
        residence = record[1] * fade + record[3] * (1.0 - fade) / self._lambda
        return record[0] * fade, residence, record[2] * fade, record

    def _update(self, kind: str, tokens: int, restored: float, taken: float, live: float) -> None:
        for key in self._keys(kind, tokens):
            now_restored, residence, now_taken, record = self._now(key)
            record[:] = [now_restored + restored, residence, now_taken + taken, record[3] + live, self._clock]

    def taken(self, kind: str, tokens: int, new: bool = True) -> None:
        """An entry of this kind and depth was taken in (`new`: one more entry; else relabelled)."""
        if new:
            self._clock += 1.0
        self._update(kind, tokens, 0.0, 1.0, 1.0)

    def left(self, kind: str, tokens: int) -> None:
        """An entry of this kind and depth left (or was relabelled)."""
        self._update(kind, tokens, 0.0, 0.0, -1.0)

    def restored(self, kind: str, tokens: int) -> None:
        """An entry of this kind and depth was restored."""
        self._update(kind, tokens, 1.0, 0.0, 0.0)

    def _rate(self, key: tuple[str, int], prior: float, life: float) -> float:
        restored, residence, _, _ = self._now(key)
        return (restored + PRIOR_WEIGHT * prior * life) / (residence + PRIOR_WEIGHT * life)

    def rate(self, kind: str, tokens: int) -> float:
        """Expected restores per unit of residence of an entry of this kind and depth."""
        restored, residence, taken, _ = self._now(("", -1))
        if not residence or not taken:
            return 0.0
        overall, life = restored / residence, residence / taken  # the mean residence weighs the prior
        return self._rate((kind, tokens.bit_length()), self._rate((kind, -1), overall, life), life)


RESTORE_BUCKETS = 2  # entries are told apart by restores so far: 0, 1, 2 or more


def _label(kind: str, restores: int) -> str:
    """The rate label of an entry of `kind` restored `restores` times."""
    return kind if not restores else f"{kind}+{min(restores, RESTORE_BUCKETS)}"


class EntryValues:
    """Which entry of a tier to evict: GreedyDual-Frequency. An entry's priority is the tier's
    floor (the priority of the last entry evicted, so idle entries age out) plus its expected
    restore rate x the tokens a restore saves. Restore rates are learned (`ClassRates`): the
    restores per unit of residence this tier has observed for entries of the same label: kind
    (request end, prompt mark, branch point, interval mark near the prompt end or not, output mark),
    depth, and restores so far (0, 1, 2+: whether a restore predicts another is learned too, e.g. a
    conversation's turn end is restored once by the next turn, a system prompt's mark again and
    again). Sizes do not divide the value: an entry's KV is shared with the entries deeper on its
    path and leaves only with the last of them, so what it brought when it came in is not what
    evicting it frees. So a flood of rarely restored entries (deep interval marks) cannot push out
    the few that come back while the rates say so; before any restore, or among entries alike, it
    is plain LRU."""

    def __init__(self) -> None:
        self.floor = 0.0
        self._heap: list[tuple[float, int, int, BlockHash]] = []  # (priority, recency, stamp, key); stale skipped
        self._stamp: dict[BlockHash, int] = {}                    # key -> stamp of its live heap item
        self._recency: dict[BlockHash, int] = {}                  # key -> stamp of its last use (ties: LRU)
        # key -> kind, tokens, restores, the floor when it was priced
        self._worth: dict[BlockHash, tuple[str, int, int, float]] = {}
        self._next_stamp = 0
        self.rates = ClassRates()

    def prior(self, kind: str, tokens: int = 0) -> float:
        """The learned restore rate (per unit of residence) of an entry of this label and depth (0
        before any restore)."""
        return self.rates.rate(kind, tokens)

    def add(self, entry: JointEntry, restores: int = 0, kind: str | None = None) -> None:
        """Value a new entry, with `restores` it earned in a tier above; `kind` is its candidate kind
        (default: its class, END or BLOCK_END)."""
        kind = kind or entry_class(entry)
        self.rates.taken(_label(kind, restores), entry.num_tokens)
        self._worth[entry.key] = (kind, entry.num_tokens, restores, self.floor)
        self._push(entry.key)

    def restored(self, key: BlockHash) -> None:
        """A promotion reads the entry: one more restore, for it and for its label; repriced now."""
        kind, tokens, restores, _ = self._worth[key]
        self.rates.restored(_label(kind, restores), tokens)
        if _label(kind, restores + 1) != _label(kind, restores):
            self.rates.left(_label(kind, restores), tokens)
            self.rates.taken(_label(kind, restores + 1), tokens, new=False)
        self._worth[key] = (kind, tokens, restores + 1, self.floor)
        self._push(key)

    def touch(self, key: BlockHash) -> None:
        """The entry was offered again (a demotion of what the tier holds): reprice it as of now."""
        kind, tokens, restores, _ = self._worth[key]
        self._worth[key] = (kind, tokens, restores, self.floor)
        self._push(key)

    def kind(self, key: BlockHash) -> str:
        """The entry's kind (carried down a cascade)."""
        return self._worth[key][0]

    def restores(self, key: BlockHash) -> int:
        """Promotions the entry has had (carried down a cascade)."""
        return self._worth[key][2]

    def remove(self, key: BlockHash) -> None:
        """Forget an entry (its heap item goes stale)."""
        kind, tokens, restores, _ = self._worth.pop(key)
        self.rates.left(_label(kind, restores), tokens)
        del self._stamp[key], self._recency[key]

    def evicted(self, priority: float) -> None:
        """An entry of this priority was evicted: raise the floor to it (the aging of GDSF)."""
        self.floor = max(self.floor, priority)

    def lowest(self, skip: Callable[[BlockHash], bool]) -> tuple[BlockHash, float] | None:
        """The key of least priority that `skip` does not exclude, and its priority. Its class prior
        may have risen since it was priced (the rates move): it is repriced before it is chosen."""
        heap, stamps, passed, found = self._heap, self._stamp, [], None
        while heap:
            item = heapq.heappop(heap)
            key = item[3]
            if stamps.get(key) != item[2]:
                continue  # superseded by a repricing, or removed
            current = self._priority(key)
            if current > item[0] and heap and (current, item[1]) > heap[0][:2]:
                self._push(key, used=False)  # a newer, higher price: look again
                continue
            passed.append(item)
            if not skip(key):
                found = (key, item[0])
                break
        for item in passed:
            heapq.heappush(heap, item)
        return found

    def current(self, key: BlockHash) -> float:
        """The entry's priority at today's rates."""
        return self._priority(key)

    def _priority(self, key: BlockHash) -> float:
        kind, tokens, restores, base = self._worth[key]
        return base + self.rates.rate(_label(kind, restores), tokens) * tokens

    def _push(self, key: BlockHash, used: bool = True) -> None:
        """(Re)price `key` into the heap; `used`: as its most recent use (a repricing keeps its place)."""
        stamp = self._next_stamp
        self._next_stamp += 1
        self._stamp[key] = stamp
        if used:
            self._recency[key] = stamp
        heapq.heappush(self._heap, (self._priority(key), self._recency[key], stamp, key))
        if len(self._heap) > 2 * len(self._stamp) + 64:  # drop superseded items
            self._heap[:] = [item for item in self._heap if self._stamp.get(item[3]) == item[2]]
            heapq.heapify(self._heap)

    def check_integrity(self, keys: set[BlockHash]) -> None:
        """Exactly the tier's entries are valued, each with one live heap item."""
        assert set(self._worth) == keys == set(self._stamp) == set(self._recency), "entry values out of step"
        live = {key for _, _, stamp, key in self._heap if self._stamp.get(key) == stamp}
        assert live == keys, "an entry has no live eviction priority"


class _Tier:
    """One lower tier's books: LRU joint entries, per-block KV refcounts, tails, objects in flight."""

    def __init__(self, spec: TierSpec, sizes: ObjectSizes) -> None:
        if spec.budget_bytes < 0:
            raise ValueError(f"tier {spec.name}: budget must be >= 0, got {spec.budget_bytes}")
        self.name, self.budget, self.shared = spec
        self.sizes = sizes
        self.entries: OrderedDict[BlockHash, JointEntry] = OrderedDict()  # first = least recently used
        self.kv: dict[BlockHash, int] = {}                               # block hash -> entries needing it
        self.tails: dict[BlockHash, dict[BlockHash, int]] = {}           # parent (b"" at root) -> {key: tokens}
        self.writing: dict[tuple[str, BlockHash], int] = {}              # object -> ticket writing it
        self.pins: Counter[BlockHash] = Counter()                        # entries a promotion reads
        self.values = EntryValues()                                      # which entry to evict
        self.used = 0
        self.hits = self.hit_tokens = self.promotions = self.promoted_bytes = self.promoted_objects = 0
        self.demotions = self.demoted_bytes = self.demoted_objects = self.evictions = 0
        self.dropped = self.failed = self.lookups = self.discovered = 0

    def entry_bytes(self, entry: JointEntry) -> int:
        """Bytes `entry` would add here (its state and the KV blocks this tier lacks)."""
        new_blocks = sum(1 for block in set(entry.blocks) if block not in self.kv)
        return self.sizes.state_bytes + new_blocks * self.sizes.kv_block_bytes

    def ready(self, entry: JointEntry) -> bool:
        """Whether every object of `entry` has been written."""
        writing = self.writing
        return not writing or ((STATE, entry.key) not in writing
                               and not any((KV, block) in writing for block in entry.blocks))

    def has_kv(self, block: BlockHash) -> bool:
        """Whether this tier holds block `block`, written."""
        return block in self.kv and (KV, block) not in self.writing

    def add(self, entry: JointEntry, restores: int = 0, kind: str | None = None) -> list[BlockHash]:
        """Take `entry` in (with `restores` earned in a tier above, and its candidate kind); the KV
        blocks it brings (not held before)."""
        new = []
        for block in entry.blocks:
            count = self.kv.get(block, 0)
            if count == 0:
                new.append(block)
            self.kv[block] = count + 1
        self.entries[entry.key] = entry
        if entry.tail_tokens:
            self.tails.setdefault(entry.parent or b"", {})[entry.key] = entry.tail_tokens
        nbytes = self.sizes.state_bytes + len(new) * self.sizes.kv_block_bytes
        self.used += nbytes
        self.values.add(entry, restores, kind)
        return new

    def remove(self, key: BlockHash) -> list[str]:
        """Drop an entry; the store keys of the objects no entry here needs any more."""
        entry = self.entries.pop(key)
        self.values.remove(key)
        gone = [object_key(STATE, key)]
        self.writing.pop((STATE, key), None)
        for block in entry.blocks:
            count = self.kv[block] - 1
            if count:
                self.kv[block] = count
            else:
                del self.kv[block]
                self.writing.pop((KV, block), None)
                gone.append(object_key(KV, block))
        if entry.tail_tokens:
            siblings = self.tails[entry.parent or b""]
            del siblings[key]
            if not siblings:
                del self.tails[entry.parent or b""]
        self.used -= self.sizes.state_bytes + (len(gone) - 1) * self.sizes.kv_block_bytes
        return gone

    def victim(self, keep: BlockHash | None) -> tuple[JointEntry, float] | None:
        """The evictable entry (written, not being read, not `keep`) of least value, and its priority."""
        def skip(key: BlockHash) -> bool:
            return key == keep or bool(self.pins[key]) or not self.ready(self.entries[key])

        found = self.values.lowest(skip)
        return (self.entries[found[0]], found[1]) if found is not None else None

    def stats(self) -> TierStats:
        """Occupancy and counters."""
        return TierStats(self.name, self.budget, self.used, len(self.entries), len(self.kv), self.hits,
                         self.hit_tokens, self.promotions, self.promoted_bytes, self.promoted_objects,
                         self.demotions, self.demoted_bytes, self.demoted_objects, self.evictions,
                         self.dropped, self.failed, self.lookups, self.discovered)


class _Ticket(NamedTuple):
    promotion: bool
    tier: str
    entry: JointEntry
    objects: tuple[TierObject, ...]


DeviceBlocks = Callable[[BlockHash], "int | None"]
"""The device block holding a hash now (the block pool's lookup), or None."""


class TieredCache:
    """The lower tiers in order (e.g. host, then disk) and the transfers between them and the
    device. `write_through`: a published device snapshot is copied down at once (the manager calls
    `demote` at publish), otherwise on its eviction (write-back)."""

    def __init__(self, specs: Sequence[TierSpec], sizes: ObjectSizes, mover: TierMover,
                 write_through: bool = False, discovery: Discovery | None = None) -> None:
        if not specs:
            raise ValueError("a tiered cache needs at least one lower tier")
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names) or DEVICE in names:
            raise ValueError(f"tier names must be distinct and not {DEVICE!r}: {names}")
        if any(spec.shared for spec in specs[:-1]):
            raise ValueError("only the last tier may be shared")
        self.tiers = [_Tier(spec, sizes) for spec in specs]
        self._by_name = {tier.name: tier for tier in self.tiers}
        self.sizes = sizes
        self.mover = mover
        self.write_through = write_through
        self._tickets: dict[int, _Ticket] = {}
        self._next_ticket = 1
        self.shared = self.tiers[-1] if self.tiers[-1].shared else None
        self.discovery = discovery if self.shared is not None else None
        self._lookups: set[int] = set()  # discovery lookups in flight
        self._next_lookup = 1

    @property
    def names(self) -> list[str]:
        """Tier names, highest first."""
        return [tier.name for tier in self.tiers]

    def find(self, key: BlockHash) -> TierHit | None:
        """The highest tier holding a ready entry for `key` (no LRU change)."""
        for tier in self.tiers:
            entry = tier.entries.get(key)
            if entry is not None and tier.ready(entry):
                return TierHit(tier.name, entry)
        return None

    def lookup(self, block_hashes: Sequence[BlockHash], limit: int, deeper_than: int, block_size: int,
               tail_key: Callable[[int, int], BlockHash]) -> TierHit | None:
        """The deepest ready entry at a boundary in (deeper_than, limit] on this request's path: after
        `j` of its full blocks (`block_hashes`), a tail of `t` tokens (key `tail_key(j, t)`), else the
        end of block `j`; tails first, as the device lookup does."""
        for blocks in range(min(len(block_hashes), limit // block_size), -1, -1):
            if (blocks + 1) * block_size <= deeper_than:
                break
            parent = block_hashes[blocks - 1] if blocks else b""
            lengths = sorted({t for tier in self.tiers for t in tier.tails.get(parent, {}).values()}, reverse=True)
            for length in lengths:
                if deeper_than < blocks * block_size + length <= limit:
                    hit = self.find(tail_key(blocks, length))
                    if hit is not None:
                        return hit
            if blocks and deeper_than < blocks * block_size:
                hit = self.find(block_hashes[blocks - 1])
                if hit is not None:
                    return hit
        return None

    def demote(self, entry: JointEntry, state_slot: int | None, device_blocks: DeviceBlocks, into: int = 0,
               restores: int = 0, kind: str | None = None, device_kept: bool = False) -> bool:
        """Copy a joint entry into tier `into` or, where it cannot fit, the next one down; each object
        from the device (`state_slot`, `device_blocks`) or a tier holding it; `restores`: what it
        earned above (its value); `kind`: what candidate it is (its label for learned restore rates:
        "end", "prompt", "branch", "resume", "interval", "output"; default its class); `device_kept`: the
        device keeps its copy (see `TierMover.start_demotion`). False when dropped."""
        for index in range(into, len(self.tiers)):
            tier = self.tiers[index]
            if entry.key in tier.entries:
                tier.entries.move_to_end(entry.key)
                tier.values.touch(entry.key)
                return True
            if tier.entry_bytes(entry) > tier.budget:
                continue
            objects = self._sources(entry, tier, state_slot, device_blocks)
            if objects is None:
                break
            tier.add(entry, restores, kind)
            if not self._make_room(tier, index, entry.key):
                tier.remove(entry.key)  # nothing was sent for it yet
                continue
            # Making room cascades evictions down the tiers, which may have taken a source away.
            lacking = {key for key, obj in objects if obj.kind == KV}
            objects = self._sources(entry, tier, state_slot, device_blocks, lacking)
            if objects is None:
                tier.remove(entry.key)
                break
            self._start(False, tier, entry, objects, device_kept)
            return True
        self.tiers[min(into, len(self.tiers) - 1)].dropped += 1
        return False

    def _sources(self, entry: JointEntry, tier: _Tier, state_slot: int | None, device_blocks: DeviceBlocks,
                 lacking: set[BlockHash] | None = None) -> list[tuple[BlockHash, TierObject]] | None:
        """Each object `tier` lacks (with its hash; `lacking`: the KV blocks it lacked before it took
        the entry in) and where it comes from: the device first, then the highest tier holding it
        written; None when one has no source."""
        state_source = DEVICE if state_slot is not None else self._holder(STATE, entry.key, entry, tier)
        if state_source is None:
            return None
        objects = [(entry.key, TierObject(STATE, object_key(STATE, entry.key), self.sizes.state_bytes,
                                          state_source, state_slot))]
        for block in dict.fromkeys(entry.blocks):
            if block not in lacking if lacking is not None else block in tier.kv:
                continue
            device = device_blocks(block)
            source = DEVICE if device is not None else self._holder(KV, block, entry, tier)
            if source is None:
                return None
            objects.append((block, TierObject(KV, object_key(KV, block), self.sizes.kv_block_bytes, source, device)))
        return objects

    def _holder(self, kind: str, key: BlockHash, entry: JointEntry, exclude: _Tier) -> str | None:
        for tier in self.tiers:
            if tier is exclude:
                continue
            if kind == KV and tier.has_kv(key):
                return tier.name
            found = tier.entries.get(key)
            if kind == STATE and found is not None and found.num_tokens == entry.num_tokens and tier.ready(found):
                return tier.name
        return None

    def _make_room(self, tier: _Tier, index: int, new: BlockHash) -> bool:
        """Evict the least valuable entries of `tier` (each cascades to the next tier) until it fits;
        False when nothing can go, or when the entry just taken in (`new`) is itself worth least (it
        is refused rather than pushing out something worth more; the caller offers it lower)."""
        while tier.used > tier.budget:
            found = tier.victim(None)
            if found is None:
                return False
            victim, priority = found
            if victim.key == new:  # stored prices lag the moving rates: compare today's
                other = tier.victim(new)
                if other is None or tier.values.current(new) < tier.values.current(other[0].key):
                    tier.values.evicted(priority)
                    return False
                victim, priority = other
            if index + 1 < len(self.tiers):
                self.demote(victim, None, _nowhere, into=index + 1, restores=tier.values.restores(victim.key),
                            kind=tier.values.kind(victim.key))
            self._discard(tier, tier.remove(victim.key))
            tier.values.evicted(priority)
            tier.evictions += 1
        return True

    def _start(self, promotion: bool, tier: _Tier, entry: JointEntry,
               hashed: list[tuple[BlockHash, TierObject]], device_kept: bool = False) -> int:
        ticket = self._next_ticket
        self._next_ticket += 1
        objects = [obj for _, obj in hashed]
        self._tickets[ticket] = _Ticket(promotion, tier.name, entry, tuple(objects))
        nbytes = sum(o.nbytes for o in objects)
        if promotion:
            tier.pins[entry.key] += 1
            tier.entries.move_to_end(entry.key)
            tier.values.restored(entry.key)
            tier.promotions += 1
            tier.promoted_bytes += nbytes
            tier.promoted_objects += len(objects)
            self.mover.start_promotion(ticket, objects)
        else:
            for key, obj in hashed:
                tier.writing[(obj.kind, key)] = ticket
            tier.demotions += 1
            tier.demoted_bytes += nbytes
            tier.demoted_objects += len(objects)
            self.mover.start_demotion(ticket, tier.name, objects, device_kept)
        return ticket

    def hold(self, hit: TierHit, held: bool = True) -> None:
        """Pin (or, `held=False`, unpin) `hit`'s entry while the caller prepares its promotion, so the
        demotions that making room on the device cascades cannot push it out."""
        tier = self._by_name[hit.tier]
        tier.pins[hit.entry.key] += 1 if held else -1
        if not tier.pins[hit.entry.key]:
            del tier.pins[hit.entry.key]

    def kind_of(self, hit: TierHit) -> str:
        """The candidate kind `hit`'s entry was taken in as (it goes back to the device with it)."""
        return self._by_name[hit.tier].values.kind(hit.entry.key)

    def promote(self, hit: TierHit, state_slot: int, kv_targets: Sequence[tuple[BlockHash, int]]) -> int:
        """Start copying `hit`'s state into snapshot slot `state_slot` and these KV blocks into the
        device blocks given (the caller allocated them); the entry is pinned until the ticket
        completes. Returns the ticket (`complete_promotion` when the mover reports it)."""
        tier = self._by_name[hit.tier]
        key = hit.entry.key
        objects = [(key, TierObject(STATE, object_key(STATE, key), self.sizes.state_bytes, tier.name, state_slot))]
        objects += [(block, TierObject(KV, object_key(KV, block), self.sizes.kv_block_bytes, tier.name, target))
                    for block, target in kv_targets]
        return self._start(True, tier, hit.entry, objects)

    def _discard(self, tier: _Tier, keys: list[str]) -> None:
        """Tell the mover to delete objects no entry of `tier` needs; a shared tier's objects stay
        (other replicas may need them; the store's own eviction bounds it)."""
        if not tier.shared:
            self.mover.discard(tier.name, keys)

    def publish(self, entry: JointEntry, state_slot: int | None, device_blocks: DeviceBlocks,
                kind: str | None = None) -> None:
        """A device snapshot was published: copy it down now with `write_through`, and write it
        through to the shared tier (so a replica that dies has already shared it)."""
        if self.write_through:
            self.demote(entry, state_slot, device_blocks, kind=kind, device_kept=True)
        if self.shared is not None and entry.key not in self.shared.entries:
            self.demote(entry, state_slot, device_blocks, into=len(self.tiers) - 1, kind=kind, device_kept=True)

    def reusing(self, kind: str, indices: Sequence[int]) -> None:
        """Device slots or blocks about to be written (the manager allocated them): see `TierMover.reusing`."""
        self.mover.reusing(kind, indices)

    def discover(self, query: DiscoveryQuery) -> int | None:
        """Start a discovery lookup in the shared tier's store; its id (poll until `discovering` is
        False: a found entry is then in the shared tier's books), or None when none can start."""
        if self.discovery is None or self.shared is None:
            return None
        lookup = self._next_lookup
        self._next_lookup += 1
        self.shared.lookups += 1
        if not self.discovery.start_lookup(lookup, query):
            self.shared.failed += 1
            return None
        self._lookups.add(lookup)
        return lookup

    def discovering(self, lookup: int) -> bool:
        """Whether discovery lookup `lookup` is still in flight."""
        return lookup in self._lookups

    def _settle_lookups(self) -> None:
        """Adopt what finished discovery lookups found into the shared tier's books."""
        if self.discovery is None or self.shared is None:
            return
        if self.discovery.store_came_back():
            self._forget_shared()
        for lookup, entry, answered in self.discovery.poll_lookups():
            self._lookups.discard(lookup)
            if not answered:
                self.shared.failed += 1
            elif entry is not None and self._adopt_shared(entry):
                self.shared.discovered += 1

    def _forget_shared(self) -> None:
        """Drop from the shared tier's books every entry not being read or written (no deletes: the
        store may still hold them; discovery finds them again)."""
        tier = self.shared
        assert tier is not None
        for entry in [e for e in tier.entries.values() if not tier.pins[e.key] and tier.ready(e)]:
            tier.remove(entry.key)

    def _adopt_shared(self, entry: JointEntry) -> bool:
        """Take a discovered entry into the shared tier's books (ready: its objects are in the
        store), making room by forgetting the least recently used ones."""
        tier = self.shared
        assert tier is not None
        if entry.key in tier.entries:
            tier.entries.move_to_end(entry.key)
            tier.values.touch(entry.key)
            return True
        if tier.entry_bytes(entry) > tier.budget:
            return False
        tier.add(entry)
        if not self._make_room(tier, len(self.tiers) - 1, entry.key):
            tier.remove(entry.key)
            return False
        return True

    def poll(self) -> list[tuple[int, bool]]:
        """Settle what the mover finished: demotions and discovery lookups here; promotions are
        returned as (ticket, ok) for the caller, which completes each with `complete_promotion`."""
        self._settle_lookups()
        promotions = []
        for ticket, ok in self.mover.poll():
            record = self._tickets.get(ticket)
            if record is None:
                raise RuntimeError(f"the tier mover reported unknown ticket {ticket}")
            if record.promotion:
                promotions.append((ticket, ok))
            else:
                del self._tickets[ticket]
                self._complete_demotion(ticket, record, ok)
        return promotions

    def _complete_demotion(self, ticket: int, record: _Ticket, ok: bool) -> None:
        tier = self._by_name[record.tier]
        written = [item for item, owner in tier.writing.items() if owner == ticket]
        for item in written:
            del tier.writing[item]
        if ok:
            return
        tier.failed += 1
        lost = {key for _, key in written}
        # A block-end entry's key is also its last block's hash: a lost state is that entry's
        # alone, a lost KV block every entry's whose prefix holds it.
        lost_states = {key for kind, key in written if kind == STATE}
        lost_blocks = {key for kind, key in written if kind == KV}
        stale: set[BlockHash] = set()
        if tier.shared:  # objects the books hold may be gone from the store too (its own eviction)
            stale = {record.entry.key, *record.entry.blocks} - lost
        for entry in [e for e in tier.entries.values() if e.key in lost_states or lost_blocks.intersection(e.blocks)]:
            self._discard(tier, tier.remove(entry.key))
        for entry in [e for e in tier.entries.values()  # forgotten (rewritten when next published), not read now
                      if (e.key in stale or stale.intersection(e.blocks)) and not tier.pins[e.key]]:
            tier.remove(entry.key)

    def complete_promotion(self, ticket: int, ok: bool) -> JointEntry:
        """A promotion finished: unpin its entry; a failed one (corrupt or missing object) drops the
        entry from its tier, so it is a counted miss, never a wrong restore."""
        record = self._tickets.pop(ticket, None)
        if record is None or not record.promotion:
            raise KeyError(f"no promotion in flight with ticket {ticket}")
        tier = self._by_name[record.tier]
        tier.pins[record.entry.key] -= 1
        if not tier.pins[record.entry.key]:
            del tier.pins[record.entry.key]
        if not ok:
            tier.failed += 1
            if record.entry.key in tier.entries and not tier.pins[record.entry.key]:
                self._discard(tier, tier.remove(record.entry.key))
        return record.entry

    def ticket_entry(self, ticket: int) -> JointEntry:
        """The joint entry a ticket in flight moves (the mover may record it beside the objects)."""
        return self._tickets[ticket].entry

    def adopt(self, tier: str, entry: JointEntry) -> bool:
        """Take in, as most recently used and ready, an entry whose objects `tier`'s store already
        holds (a disk directory found at start-up); False when it is there or does not fit."""
        record = self._by_name[tier]
        if entry.key in record.entries or record.used + record.entry_bytes(entry) > record.budget:
            return False
        record.add(entry)
        return True

    def promotion_objects(self, ticket: int) -> tuple[TierObject, ...]:
        """The objects a promotion in flight loads."""
        return self._tickets[ticket].objects

    def pending_promotions(self) -> list[int]:
        """Tickets of promotions in flight."""
        return [ticket for ticket, record in self._tickets.items() if record.promotion]

    def forget(self, key: BlockHash) -> int:
        """Drop `key`'s entry from every tier that holds it and no promotion reads; how many."""
        return self._forget_where(lambda candidate: candidate == key)

    def reset(self) -> int:
        """Drop every entry no promotion reads, from every tier (`reset_prefix_cache`); how many. A
        local tier's objects are deleted, behind the writes already queued to its store; a shared
        tier's are only forgotten: other replicas may use them (discovery can find them again)."""
        return self._forget_where(lambda candidate: True)

    def _forget_where(self, chosen: Callable[[BlockHash], bool]) -> int:
        dropped = 0
        for tier in self.tiers:
            for key in [key for key in tier.entries if chosen(key) and not tier.pins[key]]:
                self._discard(tier, tier.remove(key))
                dropped += 1
        return dropped

    def record_hit(self, tier: str, num_tokens: int) -> None:
        """Count an admitted hit served from `tier`."""
        record = self._by_name[tier]
        record.hits += 1
        record.hit_tokens += num_tokens

    def stats(self) -> list[TierStats]:
        """Per-tier occupancy and counters, highest tier first."""
        return [tier.stats() for tier in self.tiers]

    def check_integrity(self) -> None:
        """Budgets kept, KV refcounts equal to the entries needing each block (so no KV without its
        state in the same tier), tails indexed, objects in flight and pins owned by live tickets."""
        for tier in self.tiers:
            name = tier.name
            assert tier.used <= tier.budget, f"tier {name}: {tier.used} bytes over its budget {tier.budget}"
            needs = Counter(block for entry in tier.entries.values() for block in entry.blocks)
            assert needs == Counter(tier.kv), f"tier {name}: KV refcounts out of step (orphan or missing KV)"
            expected = len(tier.entries) * self.sizes.state_bytes + len(tier.kv) * self.sizes.kv_block_bytes
            assert tier.used == expected, f"tier {name}: used bytes {tier.used} != {expected}"
            tails = {(entry.parent or b"", key) for key, entry in tier.entries.items() if entry.tail_tokens}
            assert tails == {(p, k) for p, group in tier.tails.items() for k in group}, f"tier {name}: tails"
            assert all(group for group in tier.tails.values()), f"tier {name}: empty tail group"
            tier.values.check_integrity(set(tier.entries))
            for (kind, key), ticket in tier.writing.items():
                record = self._tickets.get(ticket)
                assert record is not None and not record.promotion and record.tier == name, \
                    f"tier {name}: an object is written by no live ticket"
                held = tier.entries if kind == STATE else tier.kv
                assert key in held, f"tier {name}: the write of an object no entry needs"
            pins = Counter(record.entry.key for record in self._tickets.values()
                           if record.promotion and record.tier == name)
            assert pins == +tier.pins, f"tier {name}: pins != promotions in flight"
            assert all(key in tier.entries for key in pins), f"tier {name}: a promotion reads a gone entry"


def _nowhere(block: BlockHash) -> int | None:
    """No device block (a cascade between lower tiers reads from the tiers only)."""
    return None

"""The engine's `TierMover` (hybridserve/cache/tiers.py): moves joint-cache objects between the
device pools (GDN snapshot slots, KV blocks) and the lower tiers' stores, one `StoreMover` per tier.

- Demotion from the device: the slot's or block's tensors are copied into CPU tensors at once (the
  contract: a device source is read before the next forward, which may reuse the slot or block);
  the store writes them on its mover's thread. A write-through copy into the host tier from CPU
  pools (the device keeps its copy) is not staged: the host store copies the slot's and blocks'
  memory itself on its thread. `reusing`, which the manager calls before it hands such a slot or
  block out to be written, gives a put still queued a staged copy instead and waits for one
  already running (a disk or remote store could be slow: they still take staged copies, so nothing
  waits on them).
- Demotion from another tier (a cascade, e.g. host -> disk): a get on the source tier's mover, then,
  when it arrives, a put on the target's. A mover never runs a delete ahead of a read submitted
  before it, so a later discard of the source object cannot overtake the read.
- Promotion: a get per object, submitted in chunks of `PROMOTION_CHUNK`. Into CPU pools, from the
  disk and host tiers, the gets land in place on the store's thread (`tier_store.ReadTarget`): the
  disk reads each file straight into its reserved slot or block, the host copies the bytes it keeps
  with each object, so no decoded copy is made and the engine's thread copies nothing. Otherwise
  (the remote tier, CUDA pools) the objects that have arrived and match the device layout (names,
  shapes, dtypes) are copied into the device slot and blocks in `poll()`, which the engine calls
  between steps, never while a forward runs (so the copy of one chunk overlaps the store's read of
  the next). Any missing or malformed object fails the whole ticket: what it wrote sits in blocks
  and a slot the manager never publishes and frees (an in-flight promotion's blocks and slot stay
  reserved until its ticket finishes, even when its request goes away).

Each `StoreMover` numbers the operations submitted to it and its events carry those numbers; the
mover keeps what each operation was for by number (reads may finish ahead of queued writes).

Remote (shared) tier: a demotion's objects are puts like any other; once all of a ticket's puts
succeeded, the entry is indexed in the store (`RemoteStore.publish_entry`) so other replicas find it.
A discovery lookup (`start_lookup`) runs `RemoteStore.find_entry` on the remote mover's thread, in
order with its puts and gets; `poll_lookups` hands back what it found.

Restart: beside each state it writes to disk, the mover writes a small `meta-<hex>` object (the
joint entry: prefix block hashes, boundary, tail length). At start-up the disk tier's entries are
rebuilt from those whose state and KV objects are all present; other objects are deleted.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch

from hybridserve.cache.block_pool import block_hash_key_id
from hybridserve.cache.state_tensors import GDNStateTensors
from hybridserve.cache.store_mover import DEFAULT_MAX_PENDING, StoreMover, TierEvent
from hybridserve.cache.tier_store import (
    Payload,
    PoolLayout,
    ReadTarget,
    TierStores,
    TierStoreStats,
    build_tier_stores,
    engine_fingerprint,
)
from hybridserve.cache.tiers import (
    DEVICE,
    KV,
    STATE,
    DiscoveryQuery,
    JointEntry,
    ObjectSizes,
    TieredCache,
    TierObject,
    TierSpec,
    object_key,
)
from hybridserve.config import EngineConfig, ModelConfig, redact_url
from hybridserve.layers.attention import PagedKVCache

logger = logging.getLogger(__name__)

META = "meta"
DISK = "disk"
REMOTE = "remote"
REMOTE_BOOKS_BUDGET = 1 << 40  # the remote tier's logical budget when the server sets no maxmemory
DISK_OBJECT_OVERHEAD = 1024  # bound on a disk object's bytes beyond its tensors (header, key, safetensors header)

Purpose = Literal["write", "read-for-write", "read", "read-in-place", "delete", "index", "lookup"]


@dataclass
class _Pending:
    """What one submitted store operation is for."""

    purpose: Purpose
    ticket: int | None
    key: str
    obj: TierObject | None = None
    target: str = ""  # the tier a read-for-write feeds
    index: int = 0    # the object's position in its ticket
    reads_device: bool = False  # a put reading its device slot or block itself (`reusing` waits for it)


@dataclass
class _Ticket:
    """A ticket in flight: operations outstanding, whether all went well, payloads read so far."""

    promotion: bool
    objects: tuple[TierObject, ...]
    tier: str = ""  # a demotion's target tier
    outstanding: int = 0
    reads: int = 0  # a cascade's reads from another tier not yet arrived
    ok: bool = True
    payloads: dict[int, Payload] = field(default_factory=dict)  # object index -> payload not yet installed
    staging: list[torch.Tensor] = field(default_factory=list)  # a demotion's device copies (given back when done)


REUSE_POLL_S = 0.05  # `reusing` wakes at least this often while it waits for a put
PROMOTION_CHUNK = 32  # objects per promotion submission: each chunk is installed as it arrives
STAGING_KEPT_MAX = 256 << 20  # staging bytes kept for reuse, at most (host memory beyond the tiers' budgets)


class StagingBuffers:
    """Host buffers that demotions gather device objects into, kept for reuse once the stores have
    taken their copies: a fresh buffer is first touched page by page by the copy (page faults that
    cost more than the copy itself on the CPU), and on CUDA a reused buffer can be pinned (a fast
    device-to-host copy) without pinning every host-tier object. Capacities are powers of two
    elements; returned buffers are kept up to `limit` bytes, beyond that they are freed."""

    def __init__(self, limit: int, *, pin: bool = False) -> None:
        self.limit = limit
        self.pin = pin
        self.kept = 0  # bytes of the buffers waiting for reuse
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer of at least `numel` elements (a kept one when one fits)."""
        capacity = 1 << max(numel - 1, 0).bit_length()
        free = self._free.get((dtype, capacity))
        if free:
            buffer = free.pop()
            self.kept -= buffer.nbytes
            return buffer
        return torch.empty(capacity, dtype=dtype, pin_memory=self.pin)

    def give_back(self, buffers: Sequence[torch.Tensor]) -> None:
        """Buffers from `take` that nothing reads any more: kept for reuse while under the limit."""
        for buffer in buffers:
            if self.kept + buffer.nbytes <= self.limit:
                self._free.setdefault((buffer.dtype, buffer.numel()), []).append(buffer)
                self.kept += buffer.nbytes


def upload_stacked(sources: Sequence[torch.Tensor], device: torch.device,
                   staging: StagingBuffers) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`sources` (tensors of one shape and dtype) stacked along a new first dimension on `device`.
    Host sources are stacked into a staging buffer (pinned where `staging` pins) and copied to
    `device` in one asynchronous copy; returns the stacked tensor and that buffer, which the caller
    gives back once the copy has completed (None: no buffer was used, the sources were on `device`)."""
    if sources[0].device == device:
        return torch.stack(list(sources)), None
    shape = (len(sources), *sources[0].shape)
    buffer = staging.take(math.prod(shape), sources[0].dtype)
    host = buffer[:math.prod(shape)].view(shape)
    torch.stack(list(sources), out=host)
    return host.to(device, non_blocking=True), buffer


class DeviceCopies(NamedTuple):
    """Host copies of device objects (`payloads`, views into `buffers`), and the staging buffers to
    give back (`DeviceCachePools.release`) once every reader of the payloads is done."""

    payloads: list[Payload]
    buffers: list[torch.Tensor]


class DeviceCachePools:
    """The device tensors the tiers move: snapshot slots (GDN conv + recurrent, every layer) and KV
    blocks (every attention layer's keys and values); demotions read them into reused staging
    buffers (`StagingBuffers`, kept up to the pools' size or `STAGING_KEPT_MAX`)."""

    def __init__(self, kv_cache: PagedKVCache, snapshots: GDNStateTensors) -> None:
        self.kv_cache = kv_cache
        self.snapshots = snapshots
        self._layouts: dict[str, dict[str, tuple[torch.Size, torch.dtype]]] = {}
        tensors = [*self._stacked(STATE).values(), *self._stacked(KV).values()]
        # CPU pools take promotions in place: a store reads each object straight into its block or slot
        pools = {kind: self._stacked(kind) for kind in (STATE, KV)}
        self._in_place = {kind: PoolLayout(pool) for kind, pool in pools.items()
                          if all(not t.is_cuda and t.is_contiguous() for t in pool.values())}
        self.staging = StagingBuffers(min(sum(t.nbytes for t in tensors), STAGING_KEPT_MAX),
                                      pin=tensors[0].is_cuda)

    def read_many(self, kind: str, indices: Sequence[int]) -> DeviceCopies:
        """Host copies of several snapshot slots / KV blocks: one gather per tensor into a staging
        buffer, with the objects outermost, each object's payload a contiguous view into it. The
        copy is taken now, before the next forward, which may reuse the slot or block (on CUDA a
        synchronous copy, so that no device copy waits in the stores' queues outside the memory
        plan). Give the buffers back (`release`) once the payloads are no longer read."""
        if not indices:
            return DeviceCopies([], [])
        buffers, gathered = [], {}
        for name, tensor in self._stacked(kind).items():
            where = torch.tensor(indices, dtype=torch.int64, device=tensor.device)
            shape = (len(indices), tensor.shape[0], *tensor.shape[2:])
            buffer = self.staging.take(math.prod(shape), tensor.dtype)
            target = buffer[:math.prod(shape)].view(shape)
            if tensor.is_cuda:
                target.copy_(tensor.transpose(0, 1).index_select(0, where))
            else:
                torch.index_select(tensor.transpose(0, 1), 0, where, out=target)
            buffers.append(buffer)
            gathered[name] = target.unbind(0)
        payloads = [dict(zip(gathered, views, strict=True)) for views in zip(*gathered.values(), strict=True)]
        return DeviceCopies(payloads, buffers)

    def views(self, kind: str, index: int) -> Payload | None:
        """Snapshot slot or KV block `index` of `kind` as views of the pool tensors (one object: each
        tensor without its object dimension), or None where the pools are not contiguous CPU tensors."""
        layout = self._in_place.get(kind)
        return None if layout is None else layout.tensors_of(index)

    def read_target(self, kind: str, index: int) -> ReadTarget | None:
        """Where a promoted object of `kind` lands in place (snapshot slot or KV block `index`), or
        None where the pools cannot take reads in place (CUDA: payloads are installed in `write_many`)."""
        layout = self._in_place.get(kind)
        return None if layout is None else ReadTarget(layout, index)

    def release(self, buffers: Sequence[torch.Tensor]) -> None:
        """Give back the staging buffers of a `read_many` whose payloads nothing reads any more."""
        self.staging.give_back(buffers)

    def write_many(self, kind: str, indices: Sequence[int], payloads: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Copy verified payloads into these snapshot slots / KV blocks. On the CPU each object is
        copied straight into its place (stacking them first doubled the bytes moved); on CUDA the
        objects are stacked into a pinned staging buffer and copied up in one transfer per tensor
        (`upload_stacked`: one copy from pinned memory instead of one synchronous copy from pageable
        memory per object), then scattered with one `index_copy_` per tensor, all on the compute
        stream before the next forward. (The CPU copies go as one `_foreach_copy_` per tensor: one
        call for every object, not one per object.)"""
        if not indices:
            return
        uploads: list[torch.Tensor] = []
        device = None
        for name, tensor in self._stacked(kind).items():
            sources = [payload[name] for payload in payloads]
            if not tensor.is_cuda:
                # one view per target (not `unbind`, whose views of every block of a large pool
                # cost more than the copies)
                torch._foreach_copy_([tensor.select(1, index) for index in indices], sources)
                continue
            device = tensor.device
            staged, buffer = upload_stacked(sources, device, self.staging)
            if buffer is not None:
                uploads.append(buffer)
            where = torch.tensor(indices, dtype=torch.int64, device=tensor.device)
            tensor.index_copy_(1, where, staged.transpose(0, 1))
        if uploads:
            # the next upload reuses these buffers: their copies must have left them first
            torch.cuda.current_stream(device).synchronize()
            self.staging.give_back(uploads)

    def matches(self, kind: str, payload: Mapping[str, torch.Tensor]) -> bool:
        """Whether `payload` has exactly the tensor names, shapes and dtypes of one `kind` object."""
        layout = self._layouts.get(kind)
        if layout is None:  # one object's layout: each pool tensor without its object dimension
            layout = {name: (tensor.shape[:1] + tensor.shape[2:], tensor.dtype)
                      for name, tensor in self._stacked(kind).items()}
            self._layouts[kind] = layout
        return payload.keys() == layout.keys() and all(
            (tensor.shape, tensor.dtype) == layout[name] for name, tensor in payload.items())

    def _stacked(self, kind: str) -> dict[str, torch.Tensor]:
        """Each tensor of `kind` with its objects along dimension 1 (views of the pools)."""
        if kind == STATE:
            return {"conv": self.snapshots.conv, "recurrent": self.snapshots.recurrent}
        if kind == KV:
            keys, values = self.kv_cache.keys, self.kv_cache.values
            blocks = (keys.shape[0], self.kv_cache.num_blocks, self.kv_cache.block_size, *keys.shape[2:])
            return {"keys": keys.view(blocks), "values": values.view(blocks)}
        raise ValueError(f"unknown tier object kind {kind!r}")


class EngineTierMover:
    """`TierMover` over the device pools and one `StoreMover` per lower tier (TP=1)."""

    def __init__(self, pools: DeviceCachePools, stores: TierStores) -> None:
        self.pools = pools
        self.stores = stores
        self.movers: dict[str, StoreMover] = {}
        # A promotion submits a get per KV block of its prefix at once, and a refused submit fails its
        # ticket: the queue must hold every object the device pools can hand over (twice: a cascade's
        # read and its write), or every prefix deeper than the default bound would miss.
        max_pending = max(DEFAULT_MAX_PENDING, 2 * (pools.kv_cache.num_blocks + pools.snapshots.num_slots))
        for store in stores.in_order():
            self.movers[store.tier] = StoreMover(store, max_pending=max_pending)
        self._pending: dict[str, dict[int, _Pending]] = {name: {} for name in self.movers}  # by sequence number
        self._tickets: dict[int, _Ticket] = {}
        self._finished: list[tuple[int, bool]] = []
        self._lookups = 0  # discovery lookups in flight
        self._remote_generation = 0  # the remote store's outages seen
        self._found: list[tuple[int, JointEntry | None, bool]] = []
        self.store_evicted = 0  # objects a store dropped itself (the disk's own LRU; their entries then miss)
        self.tiers: TieredCache | None = None   # bound after construction: the entries tickets move
        # device objects queued puts still read in place: (kind, index) -> {(tier, the put's seq)}
        self._device_reads: dict[tuple[str, int], set[tuple[str, int]]] = {}
        self._late_readers = {stores.host.tier} if stores.host is not None else set()
        self.reuse_waits = 0  # puts `reusing` had to wait for (they had started)
        self.restaged = 0     # queued puts `reusing` gave a staged copy instead

    def bind(self, tiers: TieredCache) -> None:
        """The logical tiers this mover serves; the disk tier's surviving entries are adopted."""
        self.tiers = tiers
        disk = self.stores.disk
        if disk is None:
            return
        keys = disk.keys()
        present, kept = set(keys), set()
        for key in keys:  # least recently used first, so recency survives the restart
            entry = _meta_entry(key, disk.get(key)) if key.startswith(META + "-") else None
            if entry is None:
                continue
            needed = {key, object_key(STATE, entry.key), *(object_key(KV, b) for b in entry.blocks)}
            if needed <= present and tiers.adopt(DISK, entry):
                kept |= needed
        for key in keys:
            if key not in kept:
                disk.delete(key)
        logger.info("disk cache tier: %d entries kept from an earlier run", tiers.stats()[-1].entries)

    @property
    def tier_names(self) -> list[str]:
        """The lower tiers, highest first."""
        return list(self.movers)

    # -- TierMover ------------------------------------------------------------------------------

    def start_demotion(self, ticket: int, tier: str, objects: Sequence[TierObject], device_kept: bool = False) -> None:
        """Copy device sources out now, or hand the host store views of them when the device keeps
        them (`_kept_views`); queue the puts (and the reads of tier sources)."""
        record = self._open(ticket, False, objects)
        record.tier = tier
        views = self._kept_views(objects) if device_kept and tier in self._late_readers else {}
        copies = {**views, **self._read_device([obj for obj in objects if obj.key not in views], record.staging)}
        batches: dict[str, list[tuple[_Pending, Payload | None]]] = {}
        for obj in objects:
            if obj.source == DEVICE:
                pending = _Pending("write", ticket, obj.key, obj, reads_device=obj.key in views)
                batches.setdefault(tier, []).append((pending, copies[obj.key]))
            else:
                record.reads += 1
                pending = _Pending("read-for-write", ticket, obj.key, obj, target=tier)
                batches.setdefault(obj.source, []).append((pending, None))
            if tier == DISK and obj.kind == STATE and self.tiers is not None:
                meta = _meta_payload(self.tiers.ticket_entry(ticket))
                batches.setdefault(tier, []).append((_Pending("write", ticket, _meta_key(obj.key)), meta))
        for source, batch in batches.items():
            # a snapshot slot read in place goes alone: its event (a submission reports when all of
            # its puts are done) comes as soon as it is copied, for `reusing` to wait on
            alone = [pending.reads_device and pending.obj is not None and pending.obj.kind == STATE
                     for pending, _ in batch]
            for part in ([item for item, first in zip(batch, alone) if first],
                         [item for item, first in zip(batch, alone) if not first]):
                if part:
                    self._submit(record, source, part)
        if tier == REMOTE and not record.reads:
            self._index_remote(record, ticket)
        self._settle(ticket)

    def reusing(self, kind: str, indices: Sequence[int]) -> None:
        """Make sure no put reads these device slots or blocks any more (see `_kept_views`): a put
        still queued gets a staged copy instead (as a write-back demotion's), one already running
        is waited for."""
        for index in indices:
            readers = self._device_reads.get((kind, index))
            if not readers:
                continue
            for tier, seq in sorted(readers):
                if seq not in self._pending[tier]:  # done while an earlier one was waited for
                    continue
                if not self._restage(tier, seq, kind, index):
                    self.reuse_waits += 1
                    self._wait_for(tier, seq)

    def start_promotion(self, ticket: int, objects: Sequence[TierObject]) -> None:
        """Queue a read of each object from its source tier: in place on the store's thread where
        the store and pools allow it, else copied to the device in `poll`."""
        record = self._open(ticket, True, objects)
        batches: dict[str, list[tuple[_Pending, ReadTarget | None]]] = {}
        for index, obj in enumerate(objects):
            if obj.device_index is None or obj.source == DEVICE:
                raise ValueError(f"promoted object {obj.key} needs a tier source and a device target")
            mover = self.movers.get(obj.source)
            target = self.pools.read_target(obj.kind, obj.device_index) if mover and mover.reads_in_place else None
            purpose: Purpose = "read" if target is None else "read-in-place"
            batches.setdefault(obj.source, []).append((_Pending(purpose, ticket, obj.key, obj, index=index), target))
        for source, batch in batches.items():
            for start in range(0, len(batch), PROMOTION_CHUNK):  # installed chunk by chunk as they arrive
                self._submit_reads(record, source, batch[start:start + PROMOTION_CHUNK])
        self._settle(ticket)

    def start_lookup(self, lookup: int, query: DiscoveryQuery) -> bool:
        """Queue a discovery lookup on the remote store's thread; False when there is no remote
        tier or its queue is full."""
        store, mover = self.stores.remote, self.movers.get(REMOTE)
        find_entry = getattr(store, "find_entry", None)
        if mover is None or find_entry is None:
            return False
        label = f"lookup-{lookup}"
        seq = mover.submit_call(label, lambda: find_entry(query), read=True)
        if seq is None:
            return False
        self._pending[REMOTE][seq] = _Pending("lookup", lookup, label)
        self._lookups += 1
        return True

    def poll_lookups(self) -> list[tuple[int, JointEntry | None, bool]]:
        """Discovery lookups finished since the last call: (lookup, entry or None, answered)."""
        self.poll_events()
        found, self._found = self._found, []
        return found

    def store_came_back(self) -> bool:
        """Whether the remote store returned from an outage since the last call."""
        generation = getattr(self.stores.remote, "generation", 0)
        came_back = generation != self._remote_generation
        self._remote_generation = generation
        return bool(came_back)

    def discard(self, tier: str, keys: Sequence[str]) -> None:
        """Queue deletes behind everything already submitted to that tier's store."""
        mover = self.movers[tier]
        for key in keys:
            for gone in (key, _meta_key(key)) if tier == DISK and key.startswith(STATE + "-") else (key,):
                self._pending[tier][mover.submit_delete(gone)] = _Pending("delete", None, gone)

    def poll(self) -> list[tuple[int, bool]]:
        """Apply finished store operations; tickets done since the last poll. Promoted objects are
        copied into the device here (the engine's thread, between steps)."""
        self.poll_events()
        finished, self._finished = self._finished, []
        return finished

    def poll_events(self) -> None:
        """Apply every store event that has arrived (kept for `poll` and `poll_lookups`)."""
        for tier, mover in self.movers.items():
            self._on_events(tier, mover.poll())

    def _on_events(self, tier: str, events: Sequence[TierEvent]) -> None:
        """Apply `events`, then install what promotions have received so far (the copy of one chunk
        runs on this thread while the store's thread reads the next)."""
        for event in events:
            self._on_event(tier, event)
        for record in self._tickets.values():
            if record.promotion and record.payloads and record.ok:
                record.ok = self._install(record)

    def hold_writes(self, held: bool) -> None:
        """Hold (or release) the background stores' queued writes: see `StoreMover.hold_writes`."""
        for mover in self.movers.values():
            mover.hold_writes(held)

    @property
    def busy(self) -> bool:
        """Whether any ticket or discovery lookup is in flight."""
        return bool(self._tickets) or self._lookups > 0

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds for the next store event (an idle engine waiting on a
        promotion sleeps here instead of spinning); events are kept for the next `poll()`."""
        for tier, mover in self.movers.items():
            if self._pending[tier]:
                self._on_events(tier, mover.poll(timeout))
                return

    # -- bookkeeping ----------------------------------------------------------------------------

    def _open(self, ticket: int, promotion: bool, objects: Sequence[TierObject]) -> _Ticket:
        if ticket in self._tickets:
            raise ValueError(f"tier ticket {ticket} is already in flight")
        record = _Ticket(promotion, tuple(objects), outstanding=1)  # held open until all are submitted
        self._tickets[ticket] = record
        return record

    def _submit(self, record: _Ticket, tier: str, batch: Sequence[tuple[_Pending, Payload | None]]) -> None:
        """Submit puts (with a payload) and gets to one tier's mover, in order and all at once; a
        refused batch (a full queue) fails the ticket."""
        mover = self.movers.get(tier)
        if mover is None:
            logger.error("tier objects %s... name unknown tier %r", batch[0][0].key, tier)
            record.ok = False
            return
        seq = mover.submit_many([(pending.key, payload) for pending, payload in batch])
        self._track(record, tier, seq, [pending for pending, _ in batch])

    def _submit_reads(self, record: _Ticket, tier: str, batch: Sequence[tuple[_Pending, ReadTarget | None]]) -> None:
        """Submit a promotion's gets: those with a target to land in place, the others as reads whose
        payloads `_install` copies in (a store without the mover, or a pool without reads in place)."""
        plain = [(pending, None) for pending, target in batch if target is None]
        in_place = [(pending, target) for pending, target in batch if target is not None]
        if plain:
            self._submit(record, tier, plain)
        if in_place:
            mover = self.movers.get(tier)
            seq = None if mover is None else mover.submit_reads_into([(p.key, target) for p, target in in_place])
            self._track(record, tier, seq, [pending for pending, _ in in_place])

    def _track(self, record: _Ticket, tier: str, seq: int | None, pendings: Sequence[_Pending]) -> None:
        """Note what a submission numbered from `seq` is for (None: refused, the ticket fails); puts
        reading device memory are noted by device object too, for `reusing`."""
        if seq is None:
            record.ok = False
            return
        record.outstanding += len(pendings)
        self._pending[tier].update(enumerate(pendings, start=seq))
        for number, pending in enumerate(pendings, start=seq):
            if pending.reads_device:
                self._device_reads.setdefault(_device_source(pending), set()).add((tier, number))

    def _settle(self, ticket: int) -> None:
        """One outstanding operation of `ticket` is done; finish it when none remain."""
        record = self._tickets[ticket]
        record.outstanding -= 1
        if record.outstanding:
            return
        del self._tickets[ticket]
        self.pools.release(record.staging)  # every put has taken its copy (or failed)
        if record.promotion and record.ok and record.payloads:
            record.ok = self._install(record)
        self._finished.append((ticket, record.ok))

    def _index_remote(self, record: _Ticket, ticket: int) -> None:
        """Queue, behind a remote demotion's puts, the index of its entry (other replicas find it
        by it): written only once every object of the entry is in the store, so it never names a
        partial entry; part of the ticket, so the entry is ready only once discoverable."""
        publish_entry = getattr(self.stores.remote, "publish_entry", None)
        if publish_entry is None or self.tiers is None:
            record.ok = False
            return
        entry = self.tiers.ticket_entry(ticket)
        label = f"entry-{entry.key.hex()}"
        seq = self.movers[REMOTE].submit_call(label, lambda: publish_entry(entry))
        if seq is None:
            record.ok = False
            return
        record.outstanding += 1
        self._pending[REMOTE][seq] = _Pending("index", ticket, label)

    def _on_event(self, tier: str, event: TierEvent) -> None:
        pending = self._pending[tier].pop(event.seq)
        if pending.key != event.key:
            raise RuntimeError(f"tier {tier}: event for {event.key!r} while expecting {pending.key!r}")
        if pending.reads_device:
            self._read_done(tier, event.seq, _device_source(pending))
        self.store_evicted += len(event.evicted)
        if pending.purpose == "lookup":
            assert pending.ticket is not None
            self._lookups -= 1
            entry, answered = event.result if event.ok else (None, False)
            self._found.append((pending.ticket, entry, answered))
            return
        if pending.purpose == "delete" or pending.ticket is None:
            return
        record = self._tickets[pending.ticket]
        if not event.ok or (pending.purpose == "index" and not event.result):
            record.ok = False
        elif pending.purpose == "read":
            assert event.payload is not None
            record.payloads[pending.index] = event.payload
        elif pending.purpose == "read-for-write" and record.ok:
            assert event.payload is not None
            self._submit(record, pending.target, [(_Pending("write", pending.ticket, pending.key, pending.obj),
                                                   event.payload)])
        if pending.purpose == "read-for-write":
            record.reads -= 1
            if not record.reads and record.ok and record.tier == REMOTE:
                self._index_remote(record, pending.ticket)  # behind the cascade's last write
        self._settle(pending.ticket)

    def _install(self, record: _Ticket) -> bool:
        """Verify the payloads a promotion has received, then copy them into the device; False (and
        nothing of them written) when one does not match. Objects installed before a later one
        fails stay in blocks and a slot the failed ticket never publishes (the manager frees them)."""
        arrived = sorted(record.payloads.items())
        for index, payload in arrived:
            obj = record.objects[index]
            if not self.pools.matches(obj.kind, payload):
                logger.warning("tier object %s from %s does not match the device layout; promotion failed",
                               obj.key, obj.source)
                return False
        for kind in (STATE, KV):
            chosen = [(record.objects[index].device_index, payload) for index, payload in arrived
                      if record.objects[index].kind == kind]
            self.pools.write_many(kind, [target for target, _ in chosen if target is not None],
                                  [payload for target, payload in chosen if target is not None])
        record.payloads.clear()
        return True

    def _kept_views(self, objects: Sequence[TierObject]) -> dict[str, Payload]:
        """Views of the device sources the host store may copy on its own thread (CPU pools), by
        object key. The device keeps them until the manager hands the slot or block out again, and
        `reusing` waits for the put first."""
        views: dict[str, Payload] = {}
        for obj in objects:
            if obj.source == DEVICE and obj.device_index is not None:
                view = self.pools.views(obj.kind, obj.device_index)
                if view is not None:
                    views[obj.key] = view
        return views

    def _restage(self, tier: str, seq: int, kind: str, index: int) -> bool:
        """Copy device object `index` into staging and hand it to the queued put `seq` in place of
        its views; False (nothing changed) when the put has started already."""
        pending = self._pending[tier][seq]
        if not self.movers[tier].is_queued(seq):  # started: copying it now would be thrown away
            return False
        copy = self.pools.read_many(kind, [index])
        if not self.movers[tier].replace_payload(seq, copy.payloads[0]):
            self.pools.release(copy.buffers)
            return False
        assert pending.ticket is not None
        self._tickets[pending.ticket].staging += copy.buffers  # given back when the ticket settles
        self._read_done(tier, seq, (kind, index))
        self.restaged += 1
        return True

    def _wait_for(self, tier: str, seq: int) -> None:
        """Apply `tier`'s events until operation `seq` has completed."""
        mover = self.movers[tier]
        mover.hold_writes(False)  # never wait on a write held back for a forward
        while seq in self._pending[tier]:
            self._on_events(tier, mover.poll(REUSE_POLL_S))

    def _read_done(self, tier: str, seq: int, source: tuple[str, int]) -> None:
        """A put that read a device object in place completed (or failed)."""
        readers = self._device_reads.get(source)
        if readers is not None:
            readers.discard((tier, seq))
            if not readers:
                del self._device_reads[source]

    def _read_device(self, objects: Sequence[TierObject], staging: list[torch.Tensor]) -> dict[str, Payload]:
        """Host copies of a demotion's device sources, by object key: one gather per kind (the
        contract: read before the next forward, which may reuse the slot or block); the staging
        buffers they sit in are appended to `staging`."""
        copies: dict[str, Payload] = {}
        for kind in (STATE, KV):
            chosen = [obj for obj in objects if obj.source == DEVICE and obj.kind == kind]
            for obj in chosen:
                if obj.device_index is None:
                    raise ValueError(f"device object {obj.key} has no device index")
            read = self.pools.read_many(kind, [obj.device_index for obj in chosen if obj.device_index is not None])
            staging += read.buffers
            copies.update(zip((obj.key for obj in chosen), read.payloads, strict=True))
        return copies

    # -- lifecycle ------------------------------------------------------------------------------

    def store_stats(self) -> list[TierStoreStats]:
        """Each store's counters, highest tier first."""
        return [mover.store.stats() for mover in self.movers.values()]

    def check_stores(self) -> None:
        """Each store's own books, where it keeps any (the host store's arena slots and counters)."""
        for store in self.stores.in_order():
            check = getattr(store, "check_integrity", None)
            if callable(check):
                check()

    def close(self) -> None:
        """Finish the queued writes (so write-back objects reach the disk), then close the stores."""
        for mover in self.movers.values():
            mover.close(drain=True)
        self.stores.close()


def _device_source(pending: _Pending) -> tuple[str, int]:
    """The device object (kind, slot or block) a put of device views reads."""
    assert pending.obj is not None and pending.obj.device_index is not None
    return pending.obj.kind, pending.obj.device_index


def _meta_key(state_key: str) -> str:
    """The disk key of a state object's entry description."""
    return META + state_key.removeprefix(STATE)


def _meta_payload(entry: JointEntry) -> Payload:
    """A joint entry as tensors: its prefix block hashes (one row each) and (boundary, tail)."""
    width = len(entry.key)
    if any(len(block) != width for block in entry.blocks):
        raise ValueError("block hashes of one entry differ in length")
    blocks = torch.frombuffer(bytearray(b"".join(entry.blocks)), dtype=torch.uint8).reshape(len(entry.blocks), width)
    return {"blocks": blocks.clone(), "tokens": torch.tensor([entry.num_tokens, entry.tail_tokens], dtype=torch.int64)}


def _meta_entry(key: str, payload: Mapping[str, torch.Tensor] | None) -> JointEntry | None:
    """The joint entry a meta object describes; None when it is unreadable or names another key."""
    if payload is None or set(payload) != {"blocks", "tokens"} or payload["tokens"].shape != (2,):
        return None
    blocks = payload["blocks"]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[0] == 0:
        return None
    hashes = tuple(bytes(row.tolist()) for row in blocks)
    num_tokens, tail_tokens = (int(v) for v in payload["tokens"].tolist())
    entry_key = hashes[-1]  # a boundary's key is its last block's hash, or its tail's
    if key != _meta_key(object_key(STATE, entry_key)) or not 0 <= tail_tokens < num_tokens:
        return None
    return JointEntry(entry_key, num_tokens, hashes, tail_tokens)


def _disk_logical_budget(budget_bytes: int, sizes: ObjectSizes) -> int:
    """The disk tier's budget as the logical layer counts it (tensor bytes only): room is left for
    each object's file overhead and each state's meta object, so the store's own LRU eviction
    (which would leave entries with a missing object) stays a backstop."""
    smallest = min(sizes.state_bytes, sizes.kv_block_bytes)
    return budget_bytes * smallest // (smallest + 2 * DISK_OBJECT_OVERHEAD)


def tiers_requested(config: EngineConfig) -> bool:
    """Whether any lower-tier flag is set (`--host-cache-memory`, `--disk-cache-dir`, `--remote-cache-url`)."""
    cache = config.cache
    return bool(cache.host_cache_memory_bytes) or cache.disk_cache_dir is not None or cache.remote_cache_url is not None


def _check_shared_seed(config: EngineConfig) -> str | None:
    """The block-hash key id replicas sharing the remote store must agree on; `ValueError` when
    the hash is keyed by a seed drawn at random per start (no two replicas would ever match)."""
    cache = config.cache
    key_id = block_hash_key_id(cache.block_hash, cache.block_hash_seed, None)
    if cache.block_hash == "xxh3_128" and key_id is None:
        raise ValueError(f"--remote-cache-url {redact_url(cache.remote_cache_url or '')} needs --block-hash-seed "
                         "(or $HYBRIDSERVE_BLOCK_HASH_SEED): every replica sharing the store must hash blocks "
                         "with the same seed")
    return key_id


def build_engine_tiers(config: EngineConfig, *, model_config: ModelConfig, dtype: torch.dtype,
                       device: torch.device, tokenizer_json: str, weights: Mapping[str, torch.Tensor],
                       pools: DeviceCachePools, sizes: ObjectSizes) -> tuple[TieredCache, EngineTierMover]:
    """The lower tiers the flags ask for, over the engine's device pools: the stores (the disk's
    directory named by the model fingerprint), their movers and the logical `TieredCache`."""
    if config.tensor_parallel_size != 1:
        raise ValueError("lower cache tiers (--host-cache-memory, --disk-cache-dir, --remote-cache-url) are not "
                         "supported with "
                         f"tensor_parallel_size={config.tensor_parallel_size} yet; use tensor_parallel_size=1")
    if not config.cache.prefix_cache_enabled:
        raise ValueError("lower cache tiers need the prefix cache (prefix_cache_mib must not be 0)")
    key_id = _check_shared_seed(config) if config.cache.remote_cache_url is not None else None
    fingerprint = engine_fingerprint(config, model_config=model_config, dtype=dtype,
                                     tokenizer_json=tokenizer_json, weights=weights)
    model_id = None
    if config.cache.remote_cache_url is not None:
        model_id = engine_fingerprint(config, model_config=model_config, dtype=dtype, tokenizer_json=tokenizer_json,
                                      weights=weights, with_seed=False)
    stores = build_tier_stores(config.cache, fingerprint=fingerprint, device=device, model_id=model_id, key_id=key_id)
    mover = EngineTierMover(pools, stores)
    specs = [TierSpec(stores.host.tier, stores.host.budget_bytes)] if stores.host is not None else []
    if stores.disk is not None:
        specs.append(TierSpec(stores.disk.tier, _disk_logical_budget(stores.disk.budget_bytes, sizes)))
    if stores.remote is not None:
        specs.append(TierSpec(stores.remote.tier, stores.remote.budget_bytes or REMOTE_BOOKS_BUDGET, shared=True))
    if not specs:
        mover.close()
        raise ValueError("no lower tier has a budget (--host-cache-memory, or --disk-cache-dir with --disk-cache-size)")
    tiers = TieredCache(specs, sizes, mover, write_through=stores.write_policy == "write-through",
                        discovery=mover if stores.remote is not None else None)
    mover.bind(tiers)
    return tiers, mover

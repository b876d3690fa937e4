"""Physical stores of the lower cache tiers: host memory and a persistent disk directory.

A store holds *objects*: a `dict[str, torch.Tensor]` payload (the KV block tensors and GDN conv and
recurrent states of one joint entry, however the logical layer lays them out) under a plain string
key. The logical tiers (`hybridserve/cache/tiers.py`) decide which joint entry lives in which tier
and name the objects; the keys they give carry everything that identifies the prefix, tenant salts
included (the block hashes fold the salt in), and a store never strips or rewrites a key. Stores
are synchronous; `hybridserve/cache/store_mover.py` (`StoreMover`) runs them on a background thread so the engine
never waits on a copy or a disk.

Who evicts:
- `HostStore`: the logical layer. A put that does not fit the budget is refused and counted; the
  store never drops an object on its own (the logical layer demotes what it evicts to disk first).
- `DiskStore`: the logical layer deletes what it evicts, and the store also evicts its least
  recently used objects itself when a put would exceed its budget, so it never exceeds it; a put's
  `PutResult.evicted` names those keys so the logical index can forget them.

Disk format (one file per object, `DIR/<fingerprint>/<escaped key>.obj`, 0600 in a 0700 directory):
a fixed header (magic, format version, key length, payload length, xxh3_128 of the payload), the
key, then the payload as safetensors bytes (dtype and shape round-trip exactly). Files are written
to a `.tmp-` name and `os.replace`d, so a crash leaves either the old object, the new one, or a
temporary file that the next start removes. Files are not fsynced: after a power loss a torn file
fails its length or checksum check and is a miss. A corrupted, truncated, vanished or wrong-version
object is a counted miss and is deleted: never an exception, never wrong data.

Reads in place (`ReadTarget`): a promotion into CPU pools names, for each object, the block or slot
it fills. `DiskStore` then reads the file straight into that memory (one `preadv` of the header and
every layer's piece) and verifies the checksum over it there, with no decoded copy between;
`HostStore` copies each object's bytes out of its arena slot (plain memory copies, no tensor calls);
other stores' payloads are copied in (`copy_into`). A read that fails has still written into the target,
which the caller must not use (the tiers free a failed promotion's blocks and slot unpublished).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import struct
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol, TypeVar
from urllib.parse import unquote

import safetensors
import torch
import xxhash
from safetensors.torch import load as load_safetensors

from hybridserve.cache.block_pool import block_hash_key_id
from hybridserve.cache.host_arena import HostArena, Signature, signature_of
from hybridserve.cache.tier_dir import DiskCacheDirError, prepare_store_dir
from hybridserve.config import CacheConfig, EngineConfig

logger = logging.getLogger(__name__)

Payload = dict[str, torch.Tensor]
_Read = TypeVar("_Read")
FORMAT_VERSION = 1
MAGIC = b"HSTIER\x00\x00"
HEADER = struct.Struct("<8sIIQ16s")  # magic, format version, key length, payload length, xxh3_128
OBJECT_SUFFIX = ".obj"
TEMP_PREFIX = ".tmp-"
LOCK_NAME = ".lock"
MAX_KEY_FILENAME = 240  # escaped key length; file names are at most 255 bytes
_KEY_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
_IOV_MAX = 1024  # buffers per preadv call (Linux's and macOS's IOV_MAX)
_ALL_SAFE = re.compile(r"[A-Za-z0-9_\-]+")  # a key of `_KEY_SAFE` characters only is its own file name


@dataclass
class TierStoreStats:
    """Counters of one store (exported per tier in /metrics)."""

    tier: str
    budget_bytes: int
    objects: int = 0
    bytes: int = 0
    puts: int = 0
    refused_puts: int = 0  # did not fit the budget (host) or were larger than it (disk)
    failed_writes: int = 0  # an OSError (ENOSPC included) while writing
    gets: int = 0
    hits: int = 0
    misses: int = 0  # every get that returned None, faults included
    corrupt_misses: int = 0  # checksum, truncation, bad header or wrong version
    missing_misses: int = 0  # indexed, but the file was gone
    evictions: int = 0  # objects the store dropped itself to stay within budget
    errors: int = 0  # commands that failed on the connection (the remote store down or hung)
    transfer_seconds: float = 0.0  # time spent in puts and gets


@dataclass(frozen=True)
class PutResult:
    """What a put did: stored or not, the bytes it holds, and the keys evicted to make room."""

    ok: bool
    nbytes: int
    evicted: tuple[str, ...] = ()


class ObjectStore(Protocol):
    """A tier's physical store of payloads under string keys (thread-safe)."""

    tier: str
    budget_bytes: int

    def put(self, key: str, payload: Mapping[str, torch.Tensor], ready: Any = None) -> PutResult:
        """Store a copy of `payload` (after the CUDA event `ready`, if given); never raises for
        budget or I/O trouble, which `ok=False` reports."""
        ...

    def get(self, key: str) -> Payload | None:
        """The payload under `key`, or None (a counted miss) when absent or unreadable."""
        ...

    def delete(self, key: str) -> bool:
        """Drop `key`; whether it was there."""
        ...

    def contains(self, key: str) -> bool:
        """Whether `key` is indexed (a later get may still miss on a damaged object)."""
        ...

    def keys(self) -> list[str]:
        """Every indexed key, least recently used first."""
        ...

    def stats(self) -> TierStoreStats:
        """A copy of the counters."""
        ...

    def close(self) -> None:
        """Release the store's resources (the disk store's directory lock)."""
        ...


def payload_nbytes(payload: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the tensors' elements (what a host copy occupies)."""
    return sum(t.numel() * t.element_size() for t in payload.values())


def _host_copy(payload: Mapping[str, torch.Tensor], *, pin: bool, stream: Any, ready: Any) -> Payload:
    """Contiguous CPU copies of `payload`. CUDA sources are copied into pinned memory (when `pin`)
    on the side `stream` after the event `ready`, so the copy neither runs before the tensors are
    written nor waits for the compute stream's later work. CPU sources (what the engine's
    demotions hand over) stay pageable: torch's pinned allocator rounds each block up to a power of
    two, which would pin up to twice the host budget."""
    on_cuda = any(t.is_cuda for t in payload.values())
    if not on_cuda:
        return {name: t.detach().clone(memory_format=torch.contiguous_format) for name, t in payload.items()}
    copies: Payload = {}
    with torch.cuda.stream(stream):
        if ready is not None:
            stream.wait_event(ready)
        for name, tensor in payload.items():
            target = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            target.copy_(tensor.detach(), non_blocking=True)
            copies[name] = target
    stream.synchronize()
    return copies


def _on_host(payload: Mapping[str, torch.Tensor], stream: Any, ready: Any) -> Mapping[str, torch.Tensor]:
    """`payload` itself when it is on the CPU (encoding copies it anyway), else a host copy."""
    if all(t.device.type == "cpu" for t in payload.values()):
        return payload
    return _host_copy(payload, pin=False, stream=stream, ready=ready)


def encode_payload(payload: Mapping[str, torch.Tensor]) -> bytes:
    """Safetensors bytes of `payload` (CPU tensors), serialized straight from the tensors' memory
    (`safetensors.serialize`; the torch helper's per-tensor numpy round trip dominated a small object)."""
    tensors = {name: t.detach().contiguous() for name, t in payload.items()}  # alive while serialized
    specs = {name: safetensors.TensorSpec(dtype=str(t.dtype).removeprefix("torch."), shape=t.shape,
                                          data_ptr=t.data_ptr(), data_len=t.nbytes) for name, t in tensors.items()}
    return bytes(safetensors.serialize(specs))


def decode_payload(data: bytes) -> Payload:
    """The tensors of safetensors bytes (CPU, exact dtype and shape)."""
    return load_safetensors(data)


def key_to_filename(key: str) -> str:
    """A reversible file name for `key`: letters, digits, '_' and '-' kept, every other byte as
    %XX; `ValueError` when the key is empty or its file name would be too long."""
    if not key:
        raise ValueError("tier store key must not be empty")
    if _ALL_SAFE.fullmatch(key):
        name = key  # every object key the tiers make (kind and hex): no per-character work
    else:
        name = "".join(c if c in _KEY_SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in key)
    if len(name) > MAX_KEY_FILENAME:
        raise ValueError(f"tier store key too long for a file name ({len(name)} > {MAX_KEY_FILENAME}): {key[:40]!r}...")
    return name + OBJECT_SUFFIX


def filename_to_key(name: str) -> str:
    """The key `key_to_filename` escaped into `name`."""
    return unquote(name[: -len(OBJECT_SUFFIX)], errors="strict")


class PoolLayout:
    """How the objects of one kind lie in CPU pool tensors that hold one object per index along
    dimension 1 (e.g. KV blocks: keys and values of shape [layers, blocks, ...]): an object is one
    contiguous piece per index of dimension 0, per tensor. Gives each object's memory as writable byte
    views in the order its safetensors encoding lays the tensors out, and that encoding's header (the
    same for every object of the layout), so a file read can land in the pool as it is."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            if tensor.is_cuda or not tensor.is_contiguous() or tensor.dim() < 2:
                raise ValueError(f"pool tensor {name!r} must be a contiguous CPU tensor of >= 2 dimensions")
        self.tensors = dict(tensors)
        one_object = {name: torch.zeros(t.shape[:1] + t.shape[2:], dtype=t.dtype) for name, t in tensors.items()}
        encoded = encode_payload(one_object)
        header_end = 8 + int.from_bytes(encoded[:8], "little")
        self.encoded_header = encoded[:header_end]  # safetensors' length prefix and JSON header
        self.nbytes = len(encoded) - header_end     # tensor bytes of one object
        offsets = {name: spec["data_offsets"][0] for name, spec in json.loads(encoded[8:header_end]).items()
                   if name != "__metadata__"}
        self.signature = signature_of(one_object)
        self.names = sorted(offsets, key=offsets.__getitem__)  # encoding order
        self._pieces = []  # per tensor in encoding order: flat bytes, dim-0 stride, object stride, piece count
        for name in self.names:
            tensor = self.tensors[name]
            flat = tensor.view(-1).view(torch.uint8).numpy().data
            size = tensor.element_size()
            self._pieces.append((flat, tensor.stride(0) * size, tensor.stride(1) * size, tensor.shape[0]))

    def byte_views(self, index: int) -> list[memoryview]:
        """Writable views of object `index`'s memory, in encoding order."""
        return [flat[layer * outer + index * step:layer * outer + (index + 1) * step]
                for flat, outer, step, count in self._pieces for layer in range(count)]

    def copy_bytes_in(self, index: int, sources: Mapping[str, memoryview]) -> None:
        """Copy each tensor's contiguous bytes (`sources`, by name, of an object of this layout's
        `signature`) into object `index`, piece by piece: plain memory copies, no tensor dispatch."""
        views = iter(self.byte_views(index))
        for name, (_, _, step, count) in zip(self.names, self._pieces, strict=True):
            source = sources[name]
            for layer in range(count):
                next(views)[:] = source[layer * step:(layer + 1) * step]

    def tensors_of(self, index: int) -> Payload:
        """Object `index`'s tensors (views of the pools)."""
        return {name: tensor.select(1, index) for name, tensor in self.tensors.items()}


def _contiguous_bytes(payload: Mapping[str, torch.Tensor]) -> dict[str, memoryview]:
    """Each contiguous CPU tensor's bytes as a read-only view (kept with a host object, so a read
    in place copies bytes without a tensor call)."""
    return {name: t.view(-1).view(torch.uint8).numpy().data.toreadonly() for name, t in payload.items()}


class ReadTarget(NamedTuple):
    """Where a read in place lands: object `position` of `layout`."""

    layout: PoolLayout
    position: int


def copy_into(target: ReadTarget, payload: Mapping[str, torch.Tensor]) -> bool:
    """Copy `payload` into `target`'s memory; False (nothing copied) when its tensor names, shapes or
    dtypes are not the layout's."""
    return copy_many_into([target], [payload])[0]


def copy_many_into(targets: Sequence[ReadTarget], payloads: Sequence[Mapping[str, torch.Tensor] | None]) -> list[bool]:
    """`copy_into` of each payload (None: a miss) into its target, as one `_foreach_copy_` for all
    of them (the per-copy dispatch, not the bytes, is what many small objects cost)."""
    landed: list[bool] = []
    sources: list[torch.Tensor] = []
    destinations: list[torch.Tensor] = []
    for target, payload in zip(targets, payloads, strict=True):
        destination = target.layout.tensors_of(target.position)
        fits = payload is not None and payload.keys() == destination.keys() and all(
            (t.shape, t.dtype) == (destination[name].shape, destination[name].dtype) for name, t in payload.items())
        if fits and payload is not None:
            sources += payload.values()
            destinations += (destination[name] for name in payload)
        landed.append(fits)
    if sources:
        torch._foreach_copy_(destinations, sources)
    return landed


def _cuda_copy_stream(device: torch.device | None) -> Any:
    if device is not None and device.type == "cuda":
        return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]  # torch leaves it untyped
    return None


class HostStore:
    """Objects in host memory under a byte budget. On the CPU each object is copied into a slot of
    a `HostArena` (memory kept for reuse, no Python objects per stored object); one that finds no
    slot (the arena's chunks are held by other layouts) is copied into memory of its own, with its
    byte views kept beside it. On CUDA objects are pinned copies made on a side stream. A put that
    does not fit the budget is refused and counted. Reads of arena objects copy out under the
    store's lock: a deleted object's slot is reused by the next put."""

    def __init__(self, budget_bytes: int, *, device: torch.device | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError(f"host cache budget must be >= 0 bytes, got {budget_bytes}")
        self.tier = "host"
        self.budget_bytes = budget_bytes
        self._pin = device is not None and device.type == "cuda"
        self._stream = _cuda_copy_stream(device)
        self._arena = None if self._pin else HostArena(budget_bytes)
        self._objects: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self._slots: dict[str, int] = {}  # objects held in the arena: their slots
        self._key_of_slot: dict[int, str] = {}  # the same, the other way (slots being written are in neither)
        self._own: dict[str, Payload] = {}  # objects in memory of their own (pinned, or no slot)
        self._bytes: dict[str, tuple[Signature, Mapping[str, memoryview]]] = {}  # byte views of `_own` CPU ones
        self._copying = (0, 0)  # bytes and arena slots reserved by puts still copying
        self._lock = threading.Lock()
        self._stats = TierStoreStats(tier=self.tier, budget_bytes=budget_bytes)

    def put(self, key: str, payload: Mapping[str, torch.Tensor], ready: Any = None) -> PutResult:
        """Store a host copy of `payload`; refused (counted, `ok=False`) when it does not fit."""
        return self.put_many([(key, payload)], ready)[0]

    def put_many(self, items: Sequence[tuple[str, Mapping[str, torch.Tensor]]], ready: Any = None) -> list[PutResult]:
        """`put` of each (key, payload) in order; the copies into arena slots go as one tensor call."""
        start = time.perf_counter()
        results: list[PutResult] = []
        planned: list[tuple[str, Mapping[str, torch.Tensor], int, int | None]] = []
        slotted: list[tuple[Mapping[str, torch.Tensor], dict[str, torch.Tensor]]] = []
        with self._lock:
            try:
                for key, payload in items:
                    nbytes = payload_nbytes(payload)
                    if self._stats.bytes - self._objects.get(key, 0) + nbytes > self.budget_bytes:
                        self._stats.refused_puts += 1
                        results.append(PutResult(False, nbytes))
                        continue
                    slot = self._take_slot(payload)
                    self._stats.bytes += nbytes  # reserved while copying
                    if slot is not None:
                        assert self._arena is not None
                        slotted.append((payload, self._arena.tensors(slot)))
                    planned.append((key, payload, nbytes, slot))
                    self._reserve(planned[-1:], 1)  # copying from here on
                    results.append(PutResult(True, nbytes))
            except BaseException:
                self._unplan(planned)
                raise
        own: dict[int, Payload] = {}
        try:
            if slotted:
                _copy_into_slots(slotted)
            for number, (_, payload, _, slot) in enumerate(planned):
                if slot is None:
                    own[number] = _host_copy(payload, pin=self._pin, stream=self._stream, ready=ready)
        except BaseException:
            with self._lock:
                self._unplan(planned)
            raise
        with self._lock:
            self._reserve(planned, -1)
            for number, (key, _, nbytes, slot) in enumerate(planned):
                self._stats.bytes -= nbytes
                self._drop_locked(key)
                self._objects[key] = nbytes
                if slot is not None:
                    self._slots[key] = slot
                    self._key_of_slot[slot] = key
                else:
                    self._own[key] = own[number]
                    if not self._pin:
                        self._bytes[key] = (signature_of(own[number]), _contiguous_bytes(own[number]))
                self._stats.bytes += nbytes
                self._stats.puts += 1
            self._stats.objects = len(self._objects)
            self._stats.transfer_seconds += time.perf_counter() - start
        return results

    def _unplan(self, planned: Sequence[tuple[str, Any, int, int | None]]) -> None:
        """Give back the bytes and slots of puts that will not complete (lock held)."""
        self._reserve(planned, -1)
        for _, _, nbytes, slot in planned:
            self._stats.bytes -= nbytes
            if slot is not None and self._arena is not None:
                self._arena.give(slot)

    def _reserve(self, planned: Sequence[tuple[Any, Any, int, Any]], sign: int) -> None:
        """Note (sign 1) or forget (-1) the bytes and slots of puts that are copying (lock held)."""
        nbytes, slots = self._copying
        self._copying = (nbytes + sign * sum(p[2] for p in planned),
                         slots + sign * sum(p[3] is not None for p in planned))

    def _take_slot(self, payload: Mapping[str, torch.Tensor]) -> int | None:
        """An arena slot for a CPU payload (caller holds the lock); None on CUDA or without room."""
        if self._arena is None or any(t.device.type != "cpu" for t in payload.values()):
            return None
        signature = signature_of(payload)
        slot = self._arena.take(signature)
        while slot is None and self._move_out_of_one_chunk(signature):
            slot = self._arena.take(signature)
        return slot

    def _move_out_of_one_chunk(self, signature: Signature) -> bool:
        """Make room for `signature` when the arena is full: move the objects of one chunk of another
        layout into that layout's other free slots (`HostArena.evacuation`), so the chunk empties and
        can be given back (lock held). False when no chunk can be emptied that way. Each call empties
        a chunk that held objects and fills none that was empty, so the caller's loop ends."""
        assert self._arena is not None
        moves = self._arena.evacuation(signature, self._key_of_slot.__contains__)
        if not moves:
            return False
        sources, destinations = [], []
        for old, new in moves:
            target = self._arena.tensors(new)
            for name, tensor in self._arena.tensors(old).items():
                sources.append(tensor)
                destinations.append(target[name])
        torch._foreach_copy_(destinations, sources)
        for old, new in moves:
            key = self._key_of_slot.pop(old)
            self._slots[key] = new
            self._key_of_slot[new] = key
            self._arena.give(old)
        return True

    def get(self, key: str) -> Payload | None:
        """The tensors under `key`: a copy of an arena object; a pinned one's own tensors, shared
        (read them, do not modify them)."""
        with self._lock:
            return self._get_locked(key)

    def _get_locked(self, key: str) -> Payload | None:
        self._stats.gets += 1
        if key not in self._objects:
            self._stats.misses += 1
            return None
        self._objects.move_to_end(key)
        self._stats.hits += 1
        slot = self._slots.get(key)
        if slot is not None and self._arena is not None:  # the slot is reused once the object is deleted
            return {name: t.clone() for name, t in self._arena.tensors(slot).items()}
        return dict(self._own[key])

    def get_many(self, keys: Sequence[str]) -> list[Payload | None]:
        """`get` of each key, under one lock."""
        with self._lock:
            return [self._get_locked(key) for key in keys]

    def get_many_into(self, keys: Sequence[str], targets: Sequence[ReadTarget]) -> list[bool]:
        """Copy each object under `keys` into its target (memory copies of its bytes); False for a
        miss or an object of another layout (counted as a miss)."""
        landed = []
        with self._lock:
            for key, target in zip(keys, targets, strict=True):
                self._stats.gets += 1
                if key in self._objects:
                    self._objects.move_to_end(key)
                landed.append(self._copy_out_locked(key, target))
            self._stats.hits += sum(landed)
            self._stats.misses += len(landed) - sum(landed)
        return landed

    def _copy_out_locked(self, key: str, target: ReadTarget) -> bool:
        """Copy object `key` into `target`; False when it is absent or of another layout."""
        slot = self._slots.get(key)
        if slot is not None and self._arena is not None:
            raw: tuple[Signature, Mapping[str, memoryview]] | None = (self._arena.signature(slot),
                                                                       self._arena.byte_views(slot))
        else:
            raw = self._bytes.get(key)
        if raw is None:  # pinned objects (a CUDA engine's) keep no byte views: a tensor copy
            own = self._own.get(key)
            return own is not None and copy_many_into([target], [own])[0]
        if raw[0] != target.layout.signature:
            return False
        target.layout.copy_bytes_in(target.position, raw[1])
        return True

    def delete(self, key: str) -> bool:
        """Drop `key`; whether it was there."""
        with self._lock:
            found = self._drop_locked(key)
            self._stats.objects = len(self._objects)
            return found

    def _drop_locked(self, key: str) -> bool:
        """Forget `key` and free its bytes and slot (caller holds the lock)."""
        self._bytes.pop(key, None)
        self._own.pop(key, None)
        slot = self._slots.pop(key, None)
        if slot is not None and self._arena is not None:
            del self._key_of_slot[slot]
            self._arena.give(slot)
        nbytes = self._objects.pop(key, None)
        if nbytes is None:
            return False
        self._stats.bytes -= nbytes
        return True

    def contains(self, key: str) -> bool:
        """Whether `key` is held."""
        with self._lock:
            return key in self._objects

    def keys(self) -> list[str]:
        """Held keys, least recently used first."""
        with self._lock:
            return list(self._objects)

    def stats(self) -> TierStoreStats:
        """A copy of the counters."""
        with self._lock:
            return TierStoreStats(**asdict(self._stats))

    def check_integrity(self) -> None:
        """Raise AssertionError when the held objects, their memory and the counters disagree."""
        with self._lock:
            copying_bytes, copying_slots = self._copying
            assert self._stats.bytes == sum(self._objects.values()) + copying_bytes, "host bytes out of step"
            assert self._stats.bytes <= self.budget_bytes, "host store over its budget"
            assert self._slots.keys().isdisjoint(self._own), "an object both in the arena and outside it"
            assert self._slots.keys() | self._own.keys() == self._objects.keys(), "an object without memory"
            assert self._bytes.keys() <= self._own.keys(), "byte views outlived their object"
            assert {slot: key for key, slot in self._slots.items()} == self._key_of_slot, "slot owners out of step"
            if self._arena is not None:
                assert self._arena.used_slots == len(self._slots) + copying_slots, "an arena slot has no object"
                self._arena.check_integrity()

    def close(self) -> None:
        """Drop every object and give back the arena's memory."""
        with self._lock:
            self._objects.clear()
            self._bytes.clear()
            self._slots.clear()
            self._key_of_slot.clear()
            self._own.clear()
            if self._arena is not None:
                self._arena.clear()
            self._stats.bytes = 0
            self._stats.objects = 0


def _copy_into_slots(items: Sequence[tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]]) -> None:
    """Copy each payload into its slot's tensors: one `_foreach_copy_` for all of them."""
    sources: list[torch.Tensor] = []
    destinations: list[torch.Tensor] = []
    for payload, slot in items:
        for name, tensor in payload.items():
            sources.append(tensor.detach())
            destinations.append(slot[name])
    torch._foreach_copy_(destinations, sources)


class _ObjectFault(Exception):
    """An object file that cannot be trusted (why, for the log); `missing` when it was gone."""

    def __init__(self, reason: str, *, missing: bool = False) -> None:
        super().__init__(reason)
        self.missing = missing


class DiskStore:
    """Objects as checksummed files in `DIR/<fingerprint>/`, under a byte budget with LRU
    eviction; survives restarts (the index is rebuilt from the files' headers at start)."""

    def __init__(self, directory: str | os.PathLike[str], fingerprint: str, budget_bytes: int, *,
                 device: torch.device | None = None) -> None:
        if budget_bytes < 1:
            raise ValueError(f"disk cache budget must be >= 1 byte, got {budget_bytes}")
        self.tier = "disk"
        self.budget_bytes = budget_bytes
        self.path = prepare_store_dir(directory, fingerprint)
        self._lock_fd = self._lock_directory()
        self._stream = _cuda_copy_stream(device)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, LRU first
        self._stats = TierStoreStats(tier=self.tier, budget_bytes=budget_bytes)
        self.removed_temp_files = self._remove_temp_files()
        self._load_index()
        with self._lock:
            self._evict_to(budget_bytes)

    # -- start-up -----------------------------------------------------------------------------

    def _lock_directory(self) -> int:
        """Hold an exclusive lock on the directory for this store's lifetime: its start-up removes
        temporary files, which would break another live writer."""
        fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            raise DiskCacheDirError(f"disk cache directory {str(self.path)!r} is in use by another process") from error
        return fd

    def _remove_temp_files(self) -> int:
        removed = 0
        for entry in os.scandir(self.path):
            if entry.name.startswith(TEMP_PREFIX):
                _unlink_quietly(Path(entry.path))
                removed += 1
        return removed

    def _load_index(self) -> None:
        """Index every object whose header is sound, least recently used (oldest mtime) first;
        files with a bad header or length are deleted."""
        found: list[tuple[float, str, int]] = []
        for entry in os.scandir(self.path):
            if not entry.name.endswith(OBJECT_SUFFIX) or entry.name.startswith("."):
                continue
            path = Path(entry.path)
            try:
                key = filename_to_key(entry.name)
                info = entry.stat()
                with open(path, "rb") as handle:
                    _check_header(handle.read(HEADER.size + len(key.encode())), key, info.st_size)
                found.append((info.st_mtime, key, info.st_size))
            except (OSError, ValueError, _ObjectFault) as fault:
                logger.warning("disk cache: dropping %s at start: %s", entry.name, fault)
                self._stats.corrupt_misses += 1
                _unlink_quietly(path)
        for _, key, size in sorted(found):
            self._index[key] = size
        self._stats.objects = len(self._index)
        self._stats.bytes = sum(self._index.values())

    # -- operations ---------------------------------------------------------------------------

    def put(self, key: str, payload: Mapping[str, torch.Tensor], ready: Any = None) -> PutResult:
        """Write `payload` under `key` (temp file, then rename), evicting least recently used
        objects to stay within budget; an OSError is a counted failed write (`ok=False`)."""
        start = time.perf_counter()
        name = key_to_filename(key)
        data = encode_payload(_on_host(payload, self._stream, ready))
        blob = _object_bytes(key, data)
        size = len(blob)
        with self._lock:
            if size > self.budget_bytes:
                self._stats.refused_puts += 1
                return PutResult(False, size)
            replaced = self._drop_from_index(key)
            evicted = self._evict_to(self.budget_bytes - size)
            self._index[key] = size  # reserved before writing, so concurrent puts stay in budget
            self._stats.bytes += size
        try:
            self._write(name, blob)
        except OSError as error:
            with self._lock:
                if self._index.get(key) == size:
                    self._drop_from_index(key)
                self._stats.failed_writes += 1
            if replaced:  # the old object was dropped from the index: its file goes too
                _unlink_quietly(self.path / name)
            logger.warning("disk cache: writing %s failed: %s", name, error.strerror or error)
            return PutResult(False, size, evicted)
        with self._lock:
            self._stats.puts += 1
            self._stats.objects = len(self._index)
            self._stats.transfer_seconds += time.perf_counter() - start
        return PutResult(True, size, evicted)

    def _write(self, name: str, blob: bytes) -> None:
        temp = self.path / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.fchmod(fd, 0o600)
                _write_all(fd, blob)
            finally:
                os.close(fd)
            os.replace(temp, self.path / name)
        except OSError:
            _unlink_quietly(temp)
            raise

    def get(self, key: str) -> Payload | None:
        """The payload under `key`, read and checksum-verified; None (a counted miss, the file
        deleted) when absent, corrupted, truncated, vanished or of another format version."""
        return self._get_with(key, lambda path, file_bytes: self._read(path, key, file_bytes))

    def _get_with(self, key: str, read: Callable[[str, int], _Read | None]) -> _Read | None:
        """Look `key` up, then `read(path, indexed file bytes)`: its result, or None (a counted miss)
        when absent, when `read` returns None, or when it raises `_ObjectFault` (the file deleted)."""
        start = time.perf_counter()
        with self._lock:
            self._stats.gets += 1
            file_bytes = self._index.get(key)
            if file_bytes is None:
                self._stats.misses += 1
                return None
            self._index.move_to_end(key)
        path = os.path.join(self.path, key_to_filename(key))  # a str: cheaper than a Path per object
        try:
            result = read(path, file_bytes)
        except _ObjectFault as fault:
            self._count_fault(key, path, fault)
            return None
        with self._lock:
            if result is None:
                self._stats.misses += 1
                return None
            self._stats.hits += 1
            self._stats.transfer_seconds += time.perf_counter() - start
        _touch_quietly(path)  # the recency survives a restart (the index is ordered by mtime)
        return result

    def _read(self, path: str, key: str, file_bytes: int) -> Payload:
        def head_and_payload(fd: int) -> tuple[bytes, bytes]:
            # The header and key, then the payload into its own bytes: slicing it out of one read
            # of the whole file would copy every byte once more. One byte past the indexed size,
            # so a file longer than its header says still fails the header check.
            head = os.read(fd, HEADER.size + len(key.encode()))
            return head, _read_up_to(fd, max(file_bytes - len(head), 0) + 1)

        head, data = _read_object_file(path, head_and_payload)
        _, checksum = _check_header(head, key, len(head) + len(data))
        if xxhash.xxh3_128_digest(data) != checksum:
            raise _ObjectFault("checksum mismatch")
        try:
            return decode_payload(data)
        except Exception as error:  # a payload whose checksum matches but does not parse
            raise _ObjectFault(f"unreadable payload: {error}") from error

    def get_into(self, key: str, target: ReadTarget) -> bool:
        """Read the object under `key` straight into `target` and verify its checksum there; False
        (a counted miss, a damaged file deleted) when absent, damaged or of another layout. On False
        the target may hold part of the object: the caller must not use it."""
        landed = self._get_with(key, lambda path, file_bytes: self._read_into(path, key, file_bytes, target) or None)
        return landed is not None

    def get_many_into(self, keys: Sequence[str], targets: Sequence[ReadTarget]) -> list[bool]:
        """`get_into` of each key into its target."""
        return [self.get_into(key, target) for key, target in zip(keys, targets, strict=True)]

    def _read_into(self, path: str, key: str, file_bytes: int, target: ReadTarget) -> bool:
        """One `preadv` of the file into a header buffer and the target's byte views (and one byte
        past them, to tell a longer file); an object of another layout goes the decoding way
        (False when it does not fit the target). Raises `_ObjectFault` for a damaged object."""
        layout, key_bytes = target.layout, key.encode()
        head = bytearray(HEADER.size + len(key_bytes) + len(layout.encoded_header))
        views = layout.byte_views(target.position)
        count = _read_object_file(path, lambda fd: _preadv_all(fd, [head, *views, bytearray(1)]))
        if count < HEADER.size:
            raise _ObjectFault("truncated header")
        encoded_header = memoryview(head)[HEADER.size + len(key_bytes):]
        payload_length = HEADER.unpack_from(head)[3]
        if payload_length != len(encoded_header) + layout.nbytes or encoded_header != layout.encoded_header:
            return copy_into(target, self._read(path, key, file_bytes))  # another layout, or another writer's
        _, checksum = _check_header(head, key, count)  # count is one past the object when the file is longer
        digest = xxhash.xxh3_128(encoded_header)
        for view in views:
            digest.update(view)
        if digest.digest() != checksum:
            raise _ObjectFault("checksum mismatch")
        return True

    def _count_fault(self, key: str, path: str, fault: _ObjectFault) -> None:
        logger.warning("disk cache: object %s is a miss: %s", os.path.basename(path), fault)
        _unlink_quietly(path)
        with self._lock:
            self._drop_from_index(key)
            self._stats.misses += 1
            if fault.missing:
                self._stats.missing_misses += 1
            else:
                self._stats.corrupt_misses += 1

    def delete(self, key: str) -> bool:
        """Drop `key` and its file; whether it was indexed."""
        with self._lock:
            present = self._drop_from_index(key)
        if present:
            _unlink_quietly(self.path / key_to_filename(key))
        return present

    def contains(self, key: str) -> bool:
        """Whether `key` is indexed (its file is verified only when read)."""
        with self._lock:
            return key in self._index

    def keys(self) -> list[str]:
        """Indexed keys, least recently used first (after a restart: by file modification time)."""
        with self._lock:
            return list(self._index)

    def stats(self) -> TierStoreStats:
        """A copy of the counters."""
        with self._lock:
            return TierStoreStats(**asdict(self._stats))

    def close(self) -> None:
        """Release the directory lock (the objects stay for the next start)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # -- bookkeeping (callers hold self._lock) ---------------------------------------------------

    def _drop_from_index(self, key: str) -> bool:
        size = self._index.pop(key, None)
        if size is None:
            return False
        self._stats.bytes -= size
        self._stats.objects = len(self._index)
        return True

    def _evict_to(self, limit: int) -> tuple[str, ...]:
        """Evict least recently used objects until at most `limit` bytes are held."""
        evicted: list[str] = []
        while self._index and self._stats.bytes > limit:
            key = next(iter(self._index))
            self._drop_from_index(key)
            _unlink_quietly(self.path / key_to_filename(key))
            evicted.append(key)
        self._stats.evictions += len(evicted)
        return tuple(evicted)


def _object_bytes(key: str, data: bytes) -> bytes:
    key_bytes = key.encode()
    header = HEADER.pack(MAGIC, FORMAT_VERSION, len(key_bytes), len(data), xxhash.xxh3_128_digest(data))
    return header + key_bytes + data


def _check_header(head: bytes | bytearray, key: str, file_size: int) -> tuple[int, bytes]:
    """(payload length, checksum) of an object file whose first bytes (at least the header and
    the key) are `head`, after checking the magic, the version, the key and that the file is
    exactly as long as the header says."""
    if len(head) < HEADER.size:
        raise _ObjectFault("truncated header")
    magic, version, key_length, payload_length, checksum = HEADER.unpack_from(head)
    if magic != MAGIC:
        raise _ObjectFault("not a tier object (bad magic)")
    if version != FORMAT_VERSION:
        raise _ObjectFault(f"format version {version}, expected {FORMAT_VERSION}")
    if file_size != HEADER.size + key_length + payload_length:
        raise _ObjectFault(f"file is {file_size} bytes, header says {HEADER.size + key_length + payload_length}")
    if head[HEADER.size:HEADER.size + key_length] != key.encode():
        raise _ObjectFault("key does not match the file name")
    return int(payload_length), bytes(checksum)


def _read_up_to(fd: int, limit: int) -> bytes:
    """Up to `limit` bytes from `fd`'s position, fewer only at the end of the file."""
    data = os.read(fd, limit)
    if len(data) == limit or not data:
        return data
    parts, count = [data], len(data)
    while count < limit:
        chunk = os.read(fd, limit - count)
        if not chunk:
            break
        parts.append(chunk)
        count += len(chunk)
    return b"".join(parts)


def _read_object_file(path: str, read: Callable[[int], _Read]) -> _Read:
    """`read(fd)` of the file at `path`, opened read-only and closed after; a vanished file or an
    I/O error is an `_ObjectFault` (a miss)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            return read(fd)
        finally:
            os.close(fd)
    except FileNotFoundError as error:
        raise _ObjectFault("file is gone", missing=True) from error
    except OSError as error:
        raise _ObjectFault(f"cannot read: {error.strerror or error}") from error


def _preadv_all(fd: int, buffers: list[Any]) -> int:
    """Fill `buffers` (writable bytes-like objects, in order) from the start of `fd`, as far as the
    file goes; the bytes read."""
    pending, total = [memoryview(buffer).cast("B") for buffer in buffers], 0
    while pending:
        count = os.preadv(fd, pending[:_IOV_MAX], total)
        if count <= 0:
            break
        total += count
        while pending and count >= len(pending[0]):
            count -= len(pending.pop(0))
        if count:
            pending[0] = pending[0][count:]
    return total


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.EIO, "short write")
        view = view[written:]


def _unlink_quietly(path: str | os.PathLike[str]) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as error:
        logger.warning("disk cache: cannot remove %s: %s", path, error.strerror or error)


def _touch_quietly(path: str) -> None:
    try:
        os.utime(path)
    except OSError:
        pass  # recency is a hint; a vanished file is found on its next read


# -- model fingerprint ----------------------------------------------------------------------------


def _safetensors_header(path: Path) -> bytes:
    """The JSON header of a safetensors file (names, dtypes, shapes, offsets)."""
    with open(path, "rb") as handle:
        length_bytes = handle.read(8)
        if len(length_bytes) != 8:
            raise ValueError(f"{str(path)!r} is not a safetensors file")
        (length,) = struct.unpack("<Q", length_bytes)
        header = handle.read(length)
        if len(header) != length:
            raise ValueError(f"{str(path)!r} has a truncated safetensors header")
    return header


def _tensor_digests(weights: Mapping[str, torch.Tensor]) -> Iterator[bytes]:
    for name in sorted(weights):
        tensor = weights[name].detach().to("cpu").contiguous()
        yield f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode()
        yield xxhash.xxh3_128_digest(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())


def model_fingerprint(*, model_config: Any, dtype: str, block_size: int, block_hash: str,
                      weight_files: Sequence[Path] = (), weights: Mapping[str, torch.Tensor] | None = None,
                      tokenizer_json: str = "", extra: Mapping[str, Any] | None = None) -> str:
    """A hex name for everything that makes a cached object valid: the model config (a dataclass or
    a dict), the weights, the tokenizer (its JSON, e.g. `tokenizers.Tokenizer.to_str()`), the
    dtype, the block size, the block hash function and `extra` (quantization, tensor-parallel
    layout). Weights are identified by each safetensors file's name, size and header (cheap at
    start-up: the data is not read) or, without files (the built-in model), by the loaded tensors'
    bytes. Different inputs give different names, so a store never matches another model."""
    digest = xxhash.xxh3_128()
    config = asdict(model_config) if is_dataclass(model_config) and not isinstance(model_config, type) else model_config
    described = {"format": FORMAT_VERSION, "config": config, "dtype": dtype, "block_size": block_size,
                 "block_hash": block_hash, "extra": dict(extra or {})}
    digest.update(json.dumps(described, sort_keys=True, default=str).encode())
    digest.update(xxhash.xxh3_128_digest(tokenizer_json.encode()))
    for path in weight_files:
        digest.update(f"|file|{Path(path).name}|{Path(path).stat().st_size}|".encode())
        digest.update(_safetensors_header(Path(path)))
    if weights is not None:
        for part in _tensor_digests(weights):
            digest.update(part)
    return digest.hexdigest()


def engine_fingerprint(config: EngineConfig, *, model_config: Any, dtype: torch.dtype, tokenizer_json: str,
                       weights: Mapping[str, torch.Tensor] | None = None, with_seed: bool = True) -> str:
    """`model_fingerprint` of an engine: its checkpoint files when `config.model` is a directory,
    else `weights` (the built-in model's state dict); the quantization and the tensor-parallel size
    are part of it (they change what the stored tensors hold). `with_seed=False` leaves the
    block-hash key out (the remote store's check that replicas of one model share a seed)."""
    from hybridserve.models.loader import checkpoint_files  # the loader, not needed by the stores

    files = checkpoint_files(config.model) if config.model is not None else []
    if not files and weights is None:
        raise ValueError("the built-in model's fingerprint needs its weights")
    # the seed keying the block hash (stable with a disk tier: its seed file), named without revealing it
    key_id = block_hash_key_id(config.cache.block_hash, config.cache.block_hash_seed, config.cache.disk_cache_dir)
    if not with_seed:
        key_id = "any"
    return model_fingerprint(model_config=model_config, dtype=str(dtype), block_size=config.cache.block_size,
                             block_hash=config.cache.block_hash, weight_files=files,
                             weights=None if files else weights, tokenizer_json=tokenizer_json,
                             extra={"quantization": config.quantization,
                                    "tensor_parallel_size": config.tensor_parallel_size,
                                    "block_hash_key": key_id})


# -- construction from the configuration ------------------------------------------------------------


@dataclass
class TierStores:
    """The stores the cache flags ask for (None: that tier is off) and the write policy."""

    host: HostStore | None = None
    disk: DiskStore | None = None
    write_policy: str = "write-through"
    remote: ObjectStore | None = None  # a `RemoteStore` (hybridserve/cache/remote_store.py)

    def close(self) -> None:
        """Close every store."""
        for store in (self.host, self.disk, self.remote):
            if store is not None:
                store.close()

    def in_order(self) -> list[ObjectStore]:
        """The stores that are on, highest tier first (host, disk, remote)."""
        return [store for store in (self.host, self.disk, self.remote) if store is not None]


def build_tier_stores(config: CacheConfig, *, fingerprint: str, device: torch.device | None = None,
                      model_id: str | None = None, key_id: str | None = None) -> TierStores:
    """The host, disk and remote stores of `config` (`--host-cache-memory`, `--disk-cache-dir`,
    `--disk-cache-size`, `--remote-cache-url`); `DiskCacheDirError` when the directory cannot be
    used, `RemoteStoreError` when the remote store cannot be reached. `model_id` (the fingerprint
    without the block-hash key) and `key_id` let the remote store warn about replicas whose seeds differ."""
    host = HostStore(config.host_cache_memory_bytes, device=device) if config.host_cache_memory_bytes else None
    disk = None
    if config.disk_cache_dir is not None and config.disk_cache_size_bytes:
        disk = DiskStore(config.disk_cache_dir, fingerprint, config.disk_cache_size_bytes, device=device)
    remote = None
    if config.remote_cache_url is not None:
        try:  # the redis client is an optional dependency, needed only with the flag
            from hybridserve.cache.remote_store import RemoteStore
        except ImportError as error:
            raise ValueError(f"--remote-cache-url needs the redis client ({error}): "
                             "pip install 'hybridserve[remote]'") from None
        try:
            remote = RemoteStore(config.remote_cache_url, fingerprint, device=device, model_id=model_id, key_id=key_id)
        except BaseException:
            for store in (host, disk):
                if store is not None:
                    store.close()
            raise
    return TierStores(host=host, disk=disk, write_policy=config.tier_write_policy, remote=remote)

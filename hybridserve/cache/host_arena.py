"""Host memory for the host tier's objects (`HostArena`): slots of one object layout, in chunks that
stay allocated once made.

The arena keeps no Python object per stored object: a slot is one int, and its tensor and byte
views are made when asked for. A host tier of many objects held as tensors of their own (a dict, two
tensors and their byte views each) made every full collection of Python's cyclic collector walk
them all, a pause on whichever thread triggered it that grew with the tier. A put into a freed slot
also copies into memory touched before (no allocation, no page faults), and the store copies a whole
submission's objects with one tensor call.

The arena never holds more than its limit: a chunk that would pass it is made only after every
chunk with no object in it has been given back, and smaller when that is all the room left; the
owner can also empty a chunk of another layout by moving its objects (`evacuation`). A slot
is reused as soon as its object is deleted, so a reader must copy out what it needs while the owner
(`HostStore`) holds its lock.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

Signature = tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]
CHUNK_BYTES = 4 << 20  # one chunk of small objects; an object larger than this is a chunk alone
_ALIGN = 64  # each tensor of a slot starts on a cache line
_FIELD_BITS = 24  # a slot number: layout, chunk and index, 24 bits each for the last two
_FIELD_MASK = (1 << _FIELD_BITS) - 1
_EVACUATION_WINDOW = 64  # chunks from the end of a layout's list an evacuation looks at


def signature_of(payload: Mapping[str, torch.Tensor]) -> Signature:
    """Names, dtypes and shapes of an object's tensors, sorted by name (what a slot is made for)."""
    return tuple(sorted((name, t.dtype, tuple(t.shape)) for name, t in payload.items()))


@dataclass
class _Chunk:
    buffer: torch.Tensor  # uint8 [slots * stride]
    views: dict[str, torch.Tensor]  # per tensor name: [slots, *shape], each slot's tensor contiguous
    flat: memoryview  # the buffer's bytes, read-only
    in_use: list[bool]
    free: list[int]  # free indices, a stack (a new chunk's lowest on top)
    used: int = 0


@dataclass
class _Slab:
    """The chunks of one layout. A slot is taken from the lowest chunk with a free one, so objects
    gather in the first chunks and the last ones empty out to be given back; every operation costs
    the same however many chunks there are (no scans)."""

    number: int
    signature: Signature
    offsets: dict[str, int]
    sizes: dict[str, int]
    stride: int  # bytes from one slot to the next
    per_chunk: int
    chunks: list[_Chunk | None] = field(default_factory=list)
    open: list[int] = field(default_factory=list)  # a heap of chunks with free slots (stale entries skipped)
    holes: list[int] = field(default_factory=list)  # a heap of chunk numbers given back, reused first
    empty: set[int] = field(default_factory=set)  # chunks that hold no object
    free_slots: int = 0  # over all its chunks

    def open_chunk(self) -> int | None:
        """The lowest chunk with a free slot, if any."""
        while self.open:
            number = self.open[0]
            chunk = self.chunks[number]
            if chunk is not None and chunk.free:
                return number
            heapq.heappop(self.open)
        return None


def _layout(signature: Signature) -> tuple[dict[str, int], dict[str, int], int]:
    """Each tensor's byte offset in a slot and its size, and the slot's stride (offsets and stride
    on `_ALIGN` boundaries)."""
    offsets, sizes, end = {}, {}, 0
    for name, dtype, shape in signature:
        offsets[name] = end
        sizes[name] = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        end += -(-sizes[name] // _ALIGN) * _ALIGN
    return offsets, sizes, end


class HostArena:
    """Slots for host-tier objects, one slab of chunks per object layout, at most `limit_bytes`
    allocated in all. A slot is a plain int (its layout, chunk and index). Not thread-safe: its
    owner serializes calls."""

    def __init__(self, limit_bytes: int, *, chunk_bytes: int = CHUNK_BYTES) -> None:
        if limit_bytes < 0 or chunk_bytes < 1:
            raise ValueError(f"arena limit must be >= 0 and chunk size >= 1, got {limit_bytes}, {chunk_bytes}")
        self.limit_bytes = limit_bytes
        self.chunk_bytes = chunk_bytes
        self.allocated_bytes = 0
        self.used_slots = 0
        self._slabs: dict[Signature, _Slab] = {}
        self._by_number: list[_Slab] = []

    def take(self, signature: Signature) -> int | None:
        """A free slot for an object of `signature` (a new chunk when the layout has none free), or
        None when the limit leaves no room even after giving back the empty chunks, or when the
        object has no bytes (nothing to hold)."""
        slab = self._slab(signature)
        if slab is None:
            return None
        number = slab.open_chunk()
        if number is None:
            number = self._grow(slab)
            if number is None:
                return None
        chunk = slab.chunks[number]
        assert chunk is not None
        index = chunk.free.pop()
        chunk.in_use[index] = True
        chunk.used += 1
        slab.free_slots -= 1
        slab.empty.discard(number)
        self.used_slots += 1
        return slab.number << (2 * _FIELD_BITS) | number << _FIELD_BITS | index

    def give(self, slot: int) -> None:
        """Free `slot` (its chunk stays allocated for the next object of the layout)."""
        slab, chunk, index = self._in_use(slot)
        number = self.place(slot)[0]
        chunk.in_use[index] = False
        chunk.used -= 1
        self.used_slots -= 1
        chunk.free.append(index)  # reused first: its memory is the most recently touched
        slab.free_slots += 1
        if len(chunk.free) == 1:
            heapq.heappush(slab.open, number)
        if not chunk.used:
            slab.empty.add(number)

    def tensors(self, slot: int) -> dict[str, torch.Tensor]:
        """Views of `slot`'s memory, one contiguous tensor per name (made per call: the arena keeps
        no Python objects per slot)."""
        _, chunk, index = self._in_use(slot)
        return {name: view[index] for name, view in chunk.views.items()}

    def byte_views(self, slot: int) -> dict[str, memoryview]:
        """Read-only views of `slot`'s bytes, one per name."""
        slab, chunk, index = self._in_use(slot)
        base = index * slab.stride
        return {name: chunk.flat[base + start:base + start + slab.sizes[name]] for name, start in slab.offsets.items()}

    def signature(self, slot: int) -> Signature:
        """The layout `slot` holds objects of."""
        return self._in_use(slot)[0].signature

    @staticmethod
    def place(slot: int) -> tuple[int, int]:
        """`slot`'s chunk number in its layout and its index in the chunk."""
        return slot >> _FIELD_BITS & _FIELD_MASK, slot & _FIELD_MASK

    def evacuation(self, keep: Signature, movable: Callable[[int], bool]) -> list[tuple[int, int]]:
        """Moves that empty one chunk of a layout other than `keep`, so its memory can go to `keep`:
        (slot, new slot) pairs, the new slots taken in the layout's other chunks. The caller copies
        each object over and gives the old slots back. The chunk is the least used of its layout's
        last `_EVACUATION_WINDOW` (where objects gather least; a bounded look, not a scan) whose
        objects are all `movable` (not being written) and fit in the layout's other free slots.
        Empty when no layout has such a chunk."""
        for slab in self._by_number:
            if slab.signature == keep or not slab.free_slots:
                continue
            tail = range(len(slab.chunks) - 1, max(len(slab.chunks) - 1 - _EVACUATION_WINDOW, -1), -1)
            fits = [(c.used, -n) for n in tail if (c := slab.chunks[n]) is not None and c.used
                    and slab.free_slots - len(c.free) >= c.used]
            if not fits:
                continue
            number = -min(fits)[1]  # the least used, the later one on a tie
            chunk = slab.chunks[number]
            assert chunk is not None
            base = slab.number << (2 * _FIELD_BITS) | number << _FIELD_BITS
            old = [base | index for index, taken in enumerate(chunk.in_use) if taken]
            if not all(movable(slot) for slot in old):
                continue
            return list(zip(old, self._take_elsewhere(slab, number, len(old)), strict=True))
        return []

    def _take_elsewhere(self, slab: _Slab, number: int, count: int) -> list[int]:
        """Take `count` slots of `slab` outside chunk `number` (its free slots are set aside meanwhile)."""
        chunk = slab.chunks[number]
        assert chunk is not None
        aside, chunk.free = chunk.free, []
        slab.free_slots -= len(aside)
        try:
            taken = [self.take(slab.signature) for _ in range(count)]
        finally:
            chunk.free = aside
            slab.free_slots += len(aside)
            if aside:
                heapq.heappush(slab.open, number)
        assert None not in taken, "fewer free slots than counted"
        return [slot for slot in taken if slot is not None]

    def release_empty(self) -> int:
        """Give back every chunk that holds no object; the bytes given back."""
        released = 0
        for slab in self._by_number:
            for number in slab.empty:
                chunk = slab.chunks[number]
                assert chunk is not None
                released += chunk.buffer.numel()
                slab.free_slots -= len(chunk.free)
                slab.chunks[number] = None
                heapq.heappush(slab.holes, number)
            slab.empty.clear()
        self.allocated_bytes -= released
        return released

    def clear(self) -> None:
        """Give back every chunk (the caller has dropped every object)."""
        self._slabs.clear()
        self._by_number.clear()
        self.allocated_bytes = 0
        self.used_slots = 0

    def check_integrity(self) -> None:
        """Raise AssertionError when the counters disagree with the chunks."""
        allocated = used = 0
        for slab in self._by_number:
            live = {n: c for n, c in enumerate(slab.chunks) if c is not None}
            allocated += sum(c.buffer.numel() for c in live.values())
            used += sum(c.used for c in live.values())
            for number, chunk in live.items():
                assert set(chunk.free) == {i for i, taken in enumerate(chunk.in_use) if not taken}, \
                    f"chunk {number}: free slots disagree with the use marks"
                assert chunk.used == sum(chunk.in_use) == len(chunk.in_use) - len(chunk.free), f"chunk {number}: count"
                assert not chunk.free or number in slab.open, f"chunk {number}: free slots not findable"
            assert slab.empty == {n for n, c in live.items() if not c.used}, "empty chunks out of step"
            assert slab.free_slots == sum(len(c.free) for c in live.values()), "free slot count out of step"
            assert sorted(slab.holes) == [n for n, c in enumerate(slab.chunks) if c is None], "holes out of step"
        assert (allocated, used) == (self.allocated_bytes, self.used_slots), "arena counters disagree"
        assert self.allocated_bytes <= self.limit_bytes, "arena over its limit"

    def _in_use(self, slot: int) -> tuple[_Slab, _Chunk, int]:
        """The slab, chunk and index of a slot in use; ValueError for any other."""
        layout, (number, index) = slot >> 2 * _FIELD_BITS, self.place(slot)
        slab = self._by_number[layout] if 0 <= layout < len(self._by_number) else None
        chunk = slab.chunks[number] if slab is not None and number < len(slab.chunks) else None
        if slab is None or chunk is None or index >= len(chunk.in_use) or not chunk.in_use[index]:
            raise ValueError(f"slot {slot:#x} is not in use")
        return slab, chunk, index

    def _slab(self, signature: Signature) -> _Slab | None:
        slab = self._slabs.get(signature)
        if slab is None:
            offsets, sizes, stride = _layout(signature)
            if stride == 0:
                return None
            slab = _Slab(len(self._by_number), signature, offsets, sizes, stride, max(1, self.chunk_bytes // stride))
            self._slabs[signature] = slab
            self._by_number.append(slab)
        return slab

    def _grow(self, slab: _Slab) -> int | None:
        """Add a chunk to `slab` (`per_chunk` slots, or as many as the limit leaves room for): its
        number, or None without room."""
        room = (self.limit_bytes - self.allocated_bytes) // slab.stride
        if room < slab.per_chunk:
            self.release_empty()
            room = (self.limit_bytes - self.allocated_bytes) // slab.stride
        count = min(room, slab.per_chunk, _FIELD_MASK)
        number = slab.holes[0] if slab.holes else len(slab.chunks)
        if count < 1 or number > _FIELD_MASK:
            return None
        buffer = torch.empty(count * slab.stride, dtype=torch.uint8)
        rows = buffer.view(count, slab.stride)
        views = {name: rows[:, slab.offsets[name]:slab.offsets[name] + slab.sizes[name]].view(dtype).view(count, *shape)
                 for name, dtype, shape in slab.signature}
        chunk = _Chunk(buffer, views, buffer.numpy().data.toreadonly(), [False] * count, list(range(count - 1, -1, -1)))
        if number == len(slab.chunks):
            slab.chunks.append(chunk)
        else:
            heapq.heappop(slab.holes)
            slab.chunks[number] = chunk
        heapq.heappush(slab.open, number)
        slab.empty.add(number)
        slab.free_slots += count
        self.allocated_bytes += buffer.numel()
        return number

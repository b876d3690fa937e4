"""The host tier's arena (`HostArena`) and the host store on top of it: slots reused without
corrupting what was read before, the limit kept, every layout's puts accepted while their bytes fit
the budget, and a submission of puts run as one store call."""

from __future__ import annotations

import gc
import random
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

from hybridserve.cache.host_arena import HostArena, signature_of
from hybridserve.cache.store_mover import StoreMover
from hybridserve.cache.tier_store import HostStore, PoolLayout, PutResult, ReadTarget, payload_nbytes


def _object(seed: int, rows: int = 4) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"keys": torch.randn(2, rows, 3, generator=generator).to(torch.bfloat16),
            "values": torch.randn(2, rows, 3, generator=generator),
            "step": torch.tensor(seed, dtype=torch.int64)}


def _same(got: Mapping[str, torch.Tensor] | None, want: Mapping[str, torch.Tensor]) -> bool:
    return got is not None and got.keys() == want.keys() and all(
        got[name].dtype == t.dtype and torch.equal(got[name], t) for name, t in want.items())


def test_slots_are_views_of_one_chunk_and_their_bytes() -> None:
    arena = HostArena(1 << 20, chunk_bytes=4096)
    signature = signature_of(_object(0))
    slots = [arena.take(signature) for _ in range(3)]
    assert None not in slots and [arena.place(s) for s in slots if s is not None] == [(0, 0), (0, 1), (0, 2)]
    assert arena.allocated_bytes == 4096  # 256-byte slots (64 + 128 + 64, each tensor on a cache line)
    one, two = slots[0], slots[1]
    assert one is not None and two is not None and arena.signature(one) == signature
    first = arena.tensors(one)
    for name, tensor in _object(5).items():
        first[name].copy_(tensor)
        assert first[name].is_contiguous()
    assert _same(arena.tensors(one), _object(5))  # the views made later see it
    assert not _same(arena.tensors(two), _object(5))  # its own memory
    views = arena.byte_views(one)
    for name, tensor in _object(5).items():
        assert bytes(views[name]) == tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        assert views[name].readonly
    arena.check_integrity()


def test_a_freed_slot_is_reused_lowest_first_without_new_memory() -> None:
    arena = HostArena(1 << 20, chunk_bytes=512)  # two slots per chunk
    signature = signature_of(_object(0))
    slots = [arena.take(signature) for _ in range(5)]
    assert None not in slots
    assert [arena.place(s) for s in slots if s is not None] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    allocated = arena.allocated_bytes
    arena.give(slots[3])  # type: ignore[arg-type]
    arena.give(slots[1])  # type: ignore[arg-type]
    again = arena.take(signature)
    assert again is not None and arena.place(again) == (0, 1) and arena.allocated_bytes == allocated
    for free in (slots[3], 7 << 24):  # already free; no such chunk
        assert free is not None
        with pytest.raises(ValueError):
            arena.give(free)
        with pytest.raises(ValueError):
            arena.tensors(free)
    arena.check_integrity()


def test_the_limit_holds_and_empty_chunks_make_room_for_another_layout() -> None:
    small, large = signature_of(_object(0)), signature_of(_object(0, rows=64))  # 256- and ~2.4 KiB slots
    arena = HostArena(4096, chunk_bytes=1024)
    slots = [arena.take(small) for _ in range(16)]
    assert None not in slots and arena.take(small) is None  # four chunks fill the limit
    assert arena.allocated_bytes == 4096 and arena.take(large) is None
    for slot in slots[4:]:  # three chunks hold nothing now, one is full
        assert slot is not None
        arena.give(slot)
    assert arena.take(large) is not None  # the empty chunks are given back to make room
    assert arena.allocated_bytes <= 4096
    assert arena.take(signature_of({})) is None  # an object of no bytes takes no slot
    arena.check_integrity()
    arena.clear()
    assert arena.allocated_bytes == 0
    arena.check_integrity()


def test_a_reused_slot_leaves_an_earlier_read_intact() -> None:
    host = HostStore(1 << 20)
    assert host.put("kv-a", _object(1)).ok
    got = host.get("kv-a")
    assert host.delete("kv-a")
    assert host.put("kv-b", _object(2)).ok  # takes the slot "kv-a" had
    assert _same(got, _object(1)) and _same(host.get("kv-b"), _object(2))
    host.check_integrity()


def _pool_object(seed: int, rows: int) -> dict[str, torch.Tensor]:
    return {name: t for name, t in _object(seed, rows).items() if t.dim() >= 1}


@pytest.mark.parametrize("seed", range(4))
def test_random_puts_and_deletes_of_mixed_layouts_keep_every_object_exact(seed: int) -> None:
    """Three layouts through a budget of a few objects: a put is accepted exactly when the live
    bytes fit (also when the arena's chunks are held by another layout: the object then gets memory
    of its own), reads in place and copies out return what was put (a read into another layout's
    pool is a miss), and the books agree after each operation."""
    rng = random.Random(seed)
    shapes = [4, 16, 64]
    budget = 6 * payload_nbytes(_pool_object(0, 16))
    host = HostStore(budget)
    pools = {rows: {name: torch.zeros(t.shape[:1] + (3,) + t.shape[1:], dtype=t.dtype)
                    for name, t in _pool_object(0, rows).items()} for rows in shapes}
    layouts = {rows: PoolLayout(pool) for rows, pool in pools.items()}
    held: dict[str, tuple[int, int]] = {}
    for step in range(300):
        key = f"kv-{rng.randrange(12)}"
        action = rng.random()
        if action < 0.55:
            rows = rng.choice(shapes)
            payload = _pool_object(step, rows)
            live = sum(payload_nbytes(_pool_object(0, r)) for k, (_, r) in held.items() if k != key)
            result = host.put(key, payload)
            assert result.ok == (live + payload_nbytes(payload) <= budget)
            if result.ok:
                held[key] = (step, rows)
        elif action < 0.75:
            assert host.delete(key) == (key in held)
            held.pop(key, None)
        elif key in held:
            step_of, rows = held[key]
            assert _same(host.get(key), _pool_object(step_of, rows))
            position = rng.randrange(3)
            assert host.get_many_into([key], [ReadTarget(layouts[rows], position)]) == [True]
            assert _same(layouts[rows].tensors_of(position), _pool_object(step_of, rows))
            other = next(r for r in shapes if r != rows)
            assert host.get_many_into([key], [ReadTarget(layouts[other], position)]) == [False]
        else:
            assert host.get(key) is None
        host.check_integrity()
    assert sorted(host.keys()) == sorted(held)
    host.close()
    host.check_integrity()


def test_a_submission_of_puts_is_one_store_call() -> None:
    host = HostStore(1 << 20)
    calls: list[int] = []
    put_many = host.put_many

    def counted(items: Sequence[tuple[str, Mapping[str, torch.Tensor]]], ready: Any = None) -> list[PutResult]:
        calls.append(len(items))
        return put_many(items, ready)

    host.put_many = counted  # type: ignore[method-assign]
    mover = StoreMover(host)
    try:
        first = mover.submit_many([(f"kv-{i}", _object(i)) for i in range(5)])
        assert first is not None
        events = []
        while len(events) < 5:
            events += mover.poll(1.0)
        assert [e.seq - first for e in events] == list(range(5)) and all(e.ok for e in events)
        assert calls == [5]
        assert all(_same(host.get(f"kv-{i}"), _object(i)) for i in range(5))
    finally:
        mover.close()
    host.check_integrity()


def test_stored_objects_add_nothing_for_the_cyclic_collector() -> None:
    """The collector's full passes walk every tracked object: a host tier of many objects must not
    add tracked objects per stored object (a dict, tensors and byte views each did)."""
    host = HostStore(1 << 24)

    def tracked_after(count: int) -> int:
        assert all(host.put(f"kv-{i}", _object(i)).ok for i in range(count))
        gc.collect()
        return len(gc.get_objects())

    before = tracked_after(50)
    after = tracked_after(1050)
    assert after - before < 100, f"{after - before} tracked objects for 1,000 more stored objects"
    assert host.stats().objects == 1050
    host.check_integrity()


@pytest.mark.parametrize("seed", range(3))
def test_random_takes_gives_and_releases_across_many_chunks(seed: int) -> None:
    """Two layouts in small chunks near the limit: slots are never handed out twice, a take fails
    only when no free slot, empty chunk or room is left, freed chunk numbers are reused, and the
    books (free slots, empty chunks, holes) agree after every operation."""
    rng = random.Random(seed)
    layouts = [signature_of(_object(0)), signature_of(_object(0, rows=16))]  # 256- and 640-byte slots
    arena = HostArena(40 * 1024, chunk_bytes=1024)
    held: dict[int, Any] = {}
    for _ in range(2000):
        if held and rng.random() < 0.45:
            slot = rng.choice(list(held))
            arena.give(slot)
            del held[slot]
        elif rng.random() < 0.05:
            arena.release_empty()
        else:
            signature = rng.choice(layouts)
            slot = arena.take(signature)
            if slot is None:
                assert arena.allocated_bytes + 1024 > arena.limit_bytes  # no room for another chunk
            else:
                assert slot not in held and arena.signature(slot) == signature
                held[slot] = signature
        arena.check_integrity()
    assert arena.used_slots == len(held)
    assert max(arena.place(slot)[0] for slot in held) < 64  # chunk numbers reused, not ever growing


def test_a_full_arena_moves_another_layouts_objects_to_make_room() -> None:
    """The arena's chunks all belong to one layout, half of their slots free but spread over every
    chunk: a put of another layout moves objects out of one chunk into the free slots of the
    others (their data intact), that chunk is given back, and the new object gets a slot in the
    arena, not memory of its own."""
    small, large = _pool_object(0, 4), _pool_object(0, 64)
    host = HostStore(8 * 1024)
    host._arena = HostArena(8 * 1024, chunk_bytes=1024)  # 4 small objects (256 bytes) a chunk, 8 chunks
    for i in range(32):
        assert host.put(f"kv-{i}", _pool_object(i, 4)).ok
    for i in range(0, 32, 2):  # every chunk half full
        assert host.delete(f"kv-{i}")
    assert host.put("state", large).ok
    assert "state" in host._slots and not host._own  # in the arena
    assert all(_same(host.get(f"kv-{i}"), _pool_object(i, 4)) for i in range(1, 32, 2))
    assert _same(host.get("state"), large)
    assert host.stats().bytes == 16 * payload_nbytes(small) + payload_nbytes(large)
    host.check_integrity()


def test_an_evacuation_moves_only_objects_that_may_move_and_fit() -> None:
    small, large = signature_of(_object(0)), signature_of(_object(0, rows=64))
    arena = HostArena(2048, chunk_bytes=1024)  # two chunks of four small slots
    slots = [arena.take(small) for _ in range(8)]
    for slot in slots[1::2]:
        arena.give(slot)  # type: ignore[arg-type]
    assert arena.evacuation(large, lambda slot: False) == []  # objects being written stay
    assert arena.evacuation(small, lambda slot: True) == []  # never the layout asking
    moves = arena.evacuation(large, lambda slot: True)
    assert len(moves) == 2 and {arena.place(old)[0] for old, _ in moves} == {1}  # the later chunk empties
    assert {arena.place(new)[0] for _, new in moves} == {0}
    for old, _ in moves:
        arena.give(old)
    arena.check_integrity()
    assert arena.take(large) is None  # 1,024 bytes free: not room for a 2,304-byte slot
    arena.check_integrity()

"""Tests for hybridserve.cache.block_pool (hashing + BlockPool bookkeeping)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from hybridserve.cache.block_pool import (
    BlockPool,
    BlockPoolStats,
    block_hashes_for,
    encode_extra_keys,
    hash_block,
)

TRACE = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces" / "mooncake_conversation.jsonl"


# --------------------------------------------------------------------- hashing


def test_hash_is_16_bytes_and_deterministic() -> None:
    a = hash_block(None, [1, 2, 3, 4])
    assert isinstance(a, bytes) and len(a) == 16
    assert a == hash_block(None, [1, 2, 3, 4])
    assert a != hash_block(None, [1, 2, 3, 5])
    assert a != hash_block(a, [1, 2, 3, 4])  # parent matters


def test_same_prefix_same_hashes() -> None:
    toks = list(range(100, 120))
    other = toks[:12] + [7, 7, 7, 7, 7, 7, 7, 7]
    ha = block_hashes_for(toks, 4)
    hb = block_hashes_for(other, 4)
    assert ha[:3] == hb[:3]
    assert ha[3] != hb[3] and ha[4] != hb[4]


def test_salt_isolation() -> None:
    toks = list(range(16))
    plain = block_hashes_for(toks, 4)
    salt_a = block_hashes_for(toks, 4, ("tenant-a",))
    salt_b = block_hashes_for(toks, 4, ("tenant-b",))
    assert plain == block_hashes_for(toks, 4, ())
    assert salt_a == block_hashes_for(toks, 4, ("tenant-a",))
    assert not set(plain) & set(salt_a)
    assert not set(salt_a) & set(salt_b)


def test_extra_key_encoding_is_unambiguous() -> None:
    assert encode_extra_keys(("ab",)) != encode_extra_keys(("a", "b"))
    assert encode_extra_keys((1,)) != encode_extra_keys(("1",))
    assert encode_extra_keys((b"x",)) != encode_extra_keys(("x",))
    assert encode_extra_keys((("a",), "b")) != encode_extra_keys(("a", ("b",)))
    assert hash_block(None, [1], ("ab",)) != hash_block(None, [1], ("a", "b"))
    # token/extra boundary: tokens are length-prefixed
    assert hash_block(None, [1, 2], ()) != hash_block(None, [1], (2,))
    with pytest.raises(TypeError):
        encode_extra_keys((1.5,))


def test_chaining_change_in_block0_changes_all() -> None:
    toks = list(range(32))
    changed = [999] + toks[1:]
    ha, hb = block_hashes_for(toks, 4), block_hashes_for(changed, 4)
    assert len(ha) == len(hb) == 8
    assert all(x != y for x, y in zip(ha, hb))


def test_partial_blocks_unhashed() -> None:
    assert block_hashes_for([1, 2, 3], 4) == []
    assert len(block_hashes_for(list(range(11)), 4)) == 2
    assert block_hashes_for(list(range(11)), 4) == block_hashes_for(list(range(8)), 4)
    assert len(block_hashes_for(list(range(12)), 4)) == 3


def test_incremental_start_equals_full() -> None:
    rng = random.Random(0)
    toks = [rng.randrange(50000) for _ in range(103)]
    full = block_hashes_for(toks, 8, ("s",))
    for cut in range(0, 104, 7):
        start = block_hashes_for(toks[:cut], 8, ("s",))
        snapshot = list(start)
        assert block_hashes_for(toks, 8, ("s",), start=start) == full
        assert start == snapshot  # not mutated
    with pytest.raises(ValueError):
        block_hashes_for(toks[:8], 8, start=full)
    with pytest.raises(ValueError):
        block_hashes_for(toks, 0)


def test_hash_rejects_out_of_range_tokens() -> None:
    with pytest.raises(OverflowError):
        hash_block(None, [1 << 63])


# ------------------------------------------------------------------ block pool


def test_allocate_free_refcounts() -> None:
    pool = BlockPool(8)
    assert (pool.num_blocks, pool.num_free_blocks, pool.num_used_blocks) == (8, 8, 0)
    a = pool.allocate(3)
    assert len(set(a)) == 3
    assert all(pool.ref_count(b) == 1 for b in a)
    assert pool.num_free_blocks == 5 and pool.num_used_blocks == 3
    pool.touch(a[:2])
    assert [pool.ref_count(b) for b in a] == [2, 2, 1]
    pool.free(a)
    assert [pool.ref_count(b) for b in a] == [1, 1, 0]
    assert pool.num_free_blocks == 6
    pool.free(a[:2])
    assert pool.num_free_blocks == 8
    assert pool.allocate(0) == []
    pool.check_integrity()


def test_allocate_never_hands_out_shared_block() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.touch(a)
    b = pool.allocate(2)
    assert not set(a) & set(b)
    assert not pool.can_allocate(1)
    pool.check_integrity()


def test_errors() -> None:
    pool = BlockPool(4)
    with pytest.raises(RuntimeError):
        pool.allocate(5)
    assert pool.num_free_blocks == 4  # all-or-nothing
    assert pool.can_allocate(4) and not pool.can_allocate(5)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(ValueError):
        pool.free(blocks[:1])  # double free
    b = pool.allocate(1)
    with pytest.raises(ValueError):
        pool.free(b + b)  # more refs dropped than held; nothing changed
    assert pool.ref_count(b[0]) == 1
    with pytest.raises(ValueError):
        pool.touch([blocks[1] if blocks[1] != b[0] else blocks[0]])  # free, uncached
    with pytest.raises(IndexError):
        pool.free([17])
    with pytest.raises(ValueError):
        pool.allocate(-1)
    with pytest.raises(ValueError):
        BlockPool(0)
    pool.check_integrity()


def test_lru_eviction_order_freed_earlier_first() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    hashes = block_hashes_for(list(range(16)), 4)
    for b, h in zip(blocks, hashes):
        pool.register(b, h)
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    pool.free([blocks[3]])
    assert pool.num_cached_free_blocks == 3
    assert pool.allocate(1) == [blocks[2]]
    assert pool.lookup(hashes[2]) is None
    assert pool.allocate(1) == [blocks[0]]
    assert pool.lookup(hashes[0]) is None
    assert pool.lookup(hashes[3]) == blocks[3]
    assert pool.num_evictions == 2
    pool.check_integrity()


def test_reverse_order_free_evicts_tail_first() -> None:
    pool = BlockPool(6)
    toks = list(range(24))
    hashes = block_hashes_for(toks, 4)
    blocks = pool.allocate(6)
    for b, h in zip(blocks, hashes):
        pool.register(b, h)
    pool.free(list(reversed(blocks)))
    got = pool.allocate(2)
    assert got == [blocks[5], blocks[4]]
    # the shared prefix survives
    assert pool.longest_cached_prefix(hashes) == blocks[:4]
    pool.check_integrity()


def test_cached_free_blocks_are_free_and_reclaimed() -> None:
    pool = BlockPool(3)
    hashes = block_hashes_for(list(range(12)), 4)
    blocks = pool.allocate(3)
    for b, h in zip(blocks, hashes):
        assert pool.register(b, h)
    pool.free(blocks[::-1])
    assert pool.num_free_blocks == 3 and pool.num_cached_free_blocks == 3
    assert pool.can_allocate(3)
    assert pool.lookup(hashes[1]) == blocks[1]
    new = pool.allocate(3)
    assert sorted(new) == sorted(blocks)
    assert all(pool.lookup(h) is None for h in hashes)
    assert all(pool.block_hash(b) is None for b in new)
    assert pool.num_cached_free_blocks == 0 and pool.num_evictions == 3
    pool.check_integrity()


def test_touch_free_cached_block_leaves_free_list() -> None:
    pool = BlockPool(4)
    hashes = block_hashes_for(list(range(8)), 4)
    blocks = pool.allocate(2)
    for b, h in zip(blocks, hashes):
        pool.register(b, h)
    pool.free(blocks[::-1])
    hit = pool.longest_cached_prefix(hashes + [b"\x00" * 16])
    assert hit == blocks
    pool.touch(hit)
    assert pool.num_free_blocks == 2 and pool.num_cached_free_blocks == 0
    assert all(pool.ref_count(b) == 1 for b in blocks)
    # the touched blocks are not reclaimed by allocate
    others = pool.allocate(2)
    assert not set(others) & set(blocks)
    assert pool.lookup(hashes[0]) == blocks[0]
    assert pool.stats().touched == 2
    pool.check_integrity()


def test_longest_prefix_stops_at_first_miss() -> None:
    pool = BlockPool(4)
    hashes = block_hashes_for(list(range(16)), 4)
    blocks = pool.allocate(4)
    pool.register(blocks[0], hashes[0])
    pool.register(blocks[2], hashes[2])
    assert pool.longest_cached_prefix(hashes) == [blocks[0]]
    assert pool.longest_cached_prefix(hashes[1:]) == []
    assert pool.longest_cached_prefix([]) == []


def test_register_duplicate_hash_and_errors() -> None:
    pool = BlockPool(4)
    h0, h1 = block_hashes_for(list(range(8)), 4)
    a, b = pool.allocate(2)
    assert pool.register(a, h0)
    assert not pool.register(b, h0)  # index keeps pointing to a
    assert pool.lookup(h0) == a and pool.block_hash(b) is None
    assert pool.register(a, h0)  # idempotent
    with pytest.raises(ValueError):
        pool.register(a, h1)  # different hash on a hashed block
    assert pool.register(b, h1)
    (c,) = pool.allocate(1)
    pool.free([c])
    with pytest.raises(ValueError):
        pool.register(c, b"\x01" * 16)  # free block
    assert pool.stats().hash_entries == 2
    pool.check_integrity()


def test_reset_prefix_cache_drops_only_free_hashes() -> None:
    pool = BlockPool(4)
    hashes = block_hashes_for(list(range(16)), 4)
    blocks = pool.allocate(4)
    for b, h in zip(blocks, hashes):
        pool.register(b, h)
    pool.free(blocks[2:][::-1])
    assert pool.reset_prefix_cache() == 2
    assert pool.lookup(hashes[0]) == blocks[0] and pool.lookup(hashes[2]) is None
    assert pool.num_cached_free_blocks == 0 and pool.num_free_blocks == 2
    pool.free(blocks[:2][::-1])
    assert pool.evict_all_cached() == 2
    s = pool.stats()
    assert isinstance(s, BlockPoolStats)
    assert s == BlockPoolStats(4, 0, 4, 0, 0, 0, 0, 4)
    pool.check_integrity()


def test_check_integrity_detects_corruption() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool._ref_count[b] = 0  # corrupt: out of free list with ref 0
    with pytest.raises(AssertionError):
        pool.check_integrity()
    pool2 = BlockPool(2)
    (c,) = pool2.allocate(1)
    pool2.register(c, b"\x02" * 16)
    pool2._index[b"\x03" * 16] = c  # corrupt: stray index entry
    with pytest.raises(AssertionError):
        pool2.check_integrity()


def test_randomized_property() -> None:
    """Random request lifecycles with shared prefixes; integrity after every op."""
    rng = random.Random(1234)
    block_size = 4
    pool = BlockPool(48)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    salts = [(), ("a",)]
    active: list[list[int]] = []
    hits = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.5:
            toks = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(0, 20))]
            hashes = block_hashes_for(toks, block_size, rng.choice(salts))
            cached = pool.longest_cached_prefix(hashes)
            need = math.ceil(len(toks) / block_size) - len(cached)
            # touch first, so an allocation cannot reclaim our own hit blocks
            pool.touch(cached)
            if not pool.can_allocate(need):
                pool.free(cached[::-1])
                continue
            hits += len(cached)
            new = pool.allocate(need)
            assert not set(new) & set(cached)
            blocks = cached + new
            for i in range(len(cached), len(hashes)):
                pool.register(blocks[i], hashes[i])
            active.append(blocks)
        elif op < 0.85 and active:
            blocks = active.pop(rng.randrange(len(active)))
            pool.free(blocks[::-1])
        elif op < 0.95 and active:
            blocks = rng.choice(active)  # fork: share all blocks
            pool.touch(blocks)
            active.append(list(blocks))
        elif op < 0.97:
            pool.reset_prefix_cache()
        pool.check_integrity()
        assert pool.num_used_blocks == len({b for blocks in active for b in blocks})
    assert hits > 0 and pool.num_evictions > 0
    for blocks in active:
        pool.free(blocks[::-1])
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks and pool.num_used_blocks == 0
    pool.evict_all_cached()
    assert pool.stats().hash_entries == 0 and pool.num_cached_free_blocks == 0


# -------------------------------------------------------------- trace replay


def _scaled_tokens(hash_ids: list[int], input_length: int, tpb: int, cache: dict) -> list[int]:
    """Map each 512-token trace block to a fixed ``tpb``-token block seeded by its id."""
    toks: list[int] = []
    for hid in hash_ids:
        block = cache.get(hid)
        if block is None:
            r = random.Random(hid)
            block = cache[hid] = [r.randrange(150000) for _ in range(tpb)]
        toks.extend(block)
    last = input_length - (len(hash_ids) - 1) * 512
    keep = max(1, math.ceil(min(max(last, 1), 512) * tpb / 512))
    return toks[: (len(hash_ids) - 1) * tpb + keep]


def test_mooncake_trace_replay() -> None:
    if not TRACE.exists():
        pytest.skip(f"trace not found: {TRACE}")
    tpb, num_requests, window = 4, 2000, 8
    pool = BlockPool(4096)
    seen: set[bytes] = set()  # unbounded cache: ceiling
    token_cache: dict[int, list[int]] = {}
    active: list[list[int]] = []
    total = hit_tokens = ceiling_tokens = 0
    with TRACE.open() as f:
        for i, line in enumerate(f):
            if i >= num_requests:
                break
            req = json.loads(line)
            toks = _scaled_tokens(req["hash_ids"], req["input_length"], tpb, token_cache)
            hashes = block_hashes_for(toks, tpb)
            total += len(toks)
            ceil_hit = 0
            while ceil_hit < len(hashes) and hashes[ceil_hit] in seen:
                ceil_hit += 1
            ceiling_tokens += ceil_hit * tpb
            seen.update(hashes)
            cached = pool.longest_cached_prefix(hashes)
            pool.touch(cached)
            need = math.ceil(len(toks) / tpb) - len(cached)
            while not pool.can_allocate(need) and active:
                pool.free(active.pop(0)[::-1])  # finish the oldest running request
            if not pool.can_allocate(need):
                pool.free(cached[::-1])
                continue
            hit_tokens += len(cached) * tpb
            blocks = cached + pool.allocate(need)
            for j in range(len(cached), len(hashes)):
                pool.register(blocks[j], hashes[j])
            active.append(blocks)
            if len(active) > window:
                pool.free(active.pop(0)[::-1])
            if i % 100 == 0:
                pool.check_integrity()
    for blocks in active:
        pool.free(blocks[::-1])
    pool.check_integrity()
    hit_rate, ceiling = hit_tokens / total, ceiling_tokens / total
    assert 0 < hit_rate <= ceiling < 1
    assert pool.num_evictions > 0
    assert pool.num_free_blocks == pool.num_blocks

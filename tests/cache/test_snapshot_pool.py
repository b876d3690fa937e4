"""Tests for hybridserve.cache.snapshots (GDN state snapshot slot bookkeeping)."""

from __future__ import annotations

import random

import pytest

from hybridserve.cache.block_pool import block_hashes_for
from hybridserve.cache.snapshots import (
    Reservation,
    ReserveStatus,
    SnapshotPool,
    SnapshotPoolStats,
)

KEYS = block_hashes_for(list(range(64)), 4)
A, B, C, D = KEYS[:4]


def _publish(pool: SnapshotPool, key: bytes, num_tokens: int = 4) -> int:
    res = pool.reserve(key, num_tokens)
    assert res.status is ReserveStatus.RESERVED and res.slot is not None
    pool.publish(res)
    return res.slot


def test_reserve_publish_lookup() -> None:
    pool = SnapshotPool(2)
    res = pool.reserve(A, 16)
    assert isinstance(res, Reservation)
    assert res.status is ReserveStatus.RESERVED and res.key == A and res.num_tokens == 16
    assert pool.lookup(A) is None  # not visible before publish
    assert pool.num_reserved == 1 and pool.num_free_slots == 1
    assert pool.key_of(res.slot) == A and pool.num_tokens_of(res.slot) == 16
    pool.publish(res)
    assert pool.lookup(A) == res.slot
    assert pool.num_published == 1 and pool.num_reserved == 0
    with pytest.raises(ValueError):
        pool.publish(res)  # twice
    pool.check_integrity()


def test_abort_exposes_nothing() -> None:
    pool = SnapshotPool(1)
    res = pool.reserve(A, 4)
    pool.abort(res)
    assert pool.lookup(A) is None and pool.num_free_slots == 1
    assert pool.stats().aborted_total == 1
    with pytest.raises(ValueError):
        pool.publish(res)
    with pytest.raises(ValueError):
        pool.abort(res)  # stale
    # a re-reservation of the same key+slot does not revive the old handle
    res2 = pool.reserve(A, 4)
    assert res2.slot == res.slot
    with pytest.raises(ValueError):
        pool.publish(res)
    pool.publish(res2)
    assert pool.lookup(A) == res2.slot
    with pytest.raises(ValueError):
        pool.abort(res)  # stale handle cannot free a published slot
    assert pool.lookup(A) == res2.slot
    pool.check_integrity()


def test_slot_accessors_reject_free_slots() -> None:
    pool = SnapshotPool(2)
    with pytest.raises(ValueError):
        pool.key_of(0)
    with pytest.raises(ValueError):
        pool.num_tokens_of(1)
    with pytest.raises(IndexError):
        pool.key_of(2)
    with pytest.raises(ValueError):
        SnapshotPool(0)


def test_duplicate_refreshes_lru_and_allocates_nothing() -> None:
    pool = SnapshotPool(2)
    _publish(pool, A)
    _publish(pool, B)
    dup = pool.reserve(A, 4)
    assert dup.status is ReserveStatus.DUPLICATE and dup.slot is None
    assert pool.num_free_slots == 0 and pool.num_published == 2
    pool.abort(dup)  # no-op
    with pytest.raises(ValueError):
        pool.publish(dup)
    res = pool.reserve(C, 4)  # A was refreshed -> B is the LRU victim
    assert res.status is ReserveStatus.RESERVED and res.evicted_key == B
    assert pool.lookup(B) is None and pool.lookup(A) is not None
    # in-flight key is a duplicate too
    dup2 = pool.reserve(C, 4)
    assert dup2.status is ReserveStatus.DUPLICATE and dup2.slot is None
    pool.publish(res)
    assert pool.stats().duplicate_total == 2
    pool.check_integrity()


def test_lru_two_slots_touch() -> None:
    evicted: list[tuple[bytes, int]] = []
    pool = SnapshotPool(2, on_evict=lambda k, s: evicted.append((k, s)))
    sa = _publish(pool, A)
    sb = _publish(pool, B)
    pool.touch(A)
    res = pool.reserve(C, 8)
    assert res.status is ReserveStatus.RESERVED and res.slot == sb
    assert res.evicted_key == B and evicted == [(B, sb)]
    assert pool.lookup(B) is None and pool.lookup(A) == sa
    pool.publish(res)
    assert pool.lookup(C) == sb
    assert pool.stats().evicted_total == 1
    pool.check_integrity()


def test_lookup_does_not_refresh_lru() -> None:
    pool = SnapshotPool(2)
    _publish(pool, A)
    _publish(pool, B)
    assert pool.lookup(A) is not None
    res = pool.reserve(C, 4)
    assert res.evicted_key == A


def test_all_pinned_skipped_then_unpin() -> None:
    pool = SnapshotPool(2)
    sa = _publish(pool, A)
    sb = _publish(pool, B)
    pool.pin(sa)
    pool.pin(sb)
    pool.pin(sb)  # nested
    assert pool.num_pinned == 2
    res = pool.reserve(C, 4)
    assert res.status is ReserveStatus.SKIPPED and res.slot is None
    pool.abort(res)  # no-op
    assert pool.stats().skipped_total == 1
    assert pool.evict(A) is False and pool.clear() == 0
    pool.unpin(sb)
    assert pool.reserve(C, 4).status is ReserveStatus.SKIPPED  # still pinned once
    pool.unpin(sb)
    with pytest.raises(ValueError):
        pool.unpin(sb)
    res = pool.reserve(C, 4)
    assert res.status is ReserveStatus.RESERVED and res.slot == sb and res.evicted_key == B
    pool.publish(res)
    assert pool.lookup(A) == sa  # pinned survived
    pool.check_integrity()


def test_reserved_slots_not_evictable_and_pin_rules() -> None:
    pool = SnapshotPool(2)
    r1 = pool.reserve(A, 4)
    r2 = pool.reserve(B, 8)
    with pytest.raises(ValueError):
        pool.pin(r1.slot)  # only published slots can be pinned
    r3 = pool.reserve(C, 4)
    assert r3.status is ReserveStatus.SKIPPED
    pool.publish(r1)
    r4 = pool.reserve(C, 4)
    assert r4.slot == r1.slot and r4.evicted_key == A  # only the published one was evictable
    pool.abort(r2)
    pool.abort(r4)
    assert pool.num_free_slots == 2
    with pytest.raises(ValueError):
        pool.pin(0)
    pool.check_integrity()


def test_evict_and_clear() -> None:
    pool = SnapshotPool(4)
    sa = _publish(pool, A)
    _publish(pool, B)
    _publish(pool, C)
    pool.pin(sa)
    assert pool.evict(B) is True and pool.evict(B) is False
    assert pool.clear() == 1  # C; A is pinned
    assert pool.lookup(A) == sa and pool.num_published == 1
    pool.unpin(sa)
    assert pool.clear() == 1
    s = pool.stats()
    assert isinstance(s, SnapshotPoolStats)
    assert s == SnapshotPoolStats(4, 0, 0, 0, 3, 1, 0, 0, 0)
    pool.check_integrity()


def test_check_integrity_detects_corruption() -> None:
    pool = SnapshotPool(2)
    slot = _publish(pool, A)
    pool._pins[slot] = 1  # pinned but still in LRU and counter not updated
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_a_parent_published_after_its_child_is_covered() -> None:
    """Snapshots reserved in one step may publish child first (a request whose capture names as
    parent a snapshot another request of the step has in flight): the parent then has its child
    when it is published, and is covered from then on."""
    pool = SnapshotPool(4)
    parent = pool.reserve(A, 256)
    child = pool.reserve(B, 512, parent=A)
    pool.publish(child)
    pool.publish(parent)
    assert list(pool.covered()) == [pool.lookup(A)]
    pool.check_integrity()


def test_randomized_property() -> None:
    """Random reserve (with parents, branch points, opportunistic) / publish / abort / pin /
    unpin / touch / hit / evict; integrity (the covered list included) after every op."""
    rng = random.Random(42)
    pool = SnapshotPool(5)
    keys = KEYS[:12]
    pending: list[Reservation] = []
    pins: list[int] = []
    evicted: list[bytes] = []
    pool.on_evict = lambda k, s: evicted.append(k)
    for _ in range(4000):
        op = rng.random()
        if op < 0.3:
            parent = rng.choice([None, *keys])
            res = pool.reserve(rng.choice(keys), rng.randrange(1, 100), parent=parent,
                               opportunistic=rng.random() < 0.3, branch=rng.random() < 0.1)
            if res.status is ReserveStatus.RESERVED:
                assert pool.lookup(res.key) is None
                pending.append(res)
        elif op < 0.5 and pending:
            res = pending.pop(rng.randrange(len(pending)))
            pool.publish(res)
            assert pool.lookup(res.key) == res.slot
            assert pool.num_tokens_of(res.slot) == res.num_tokens
        elif op < 0.6 and pending:
            res = pending.pop(rng.randrange(len(pending)))
            pool.abort(res)
            assert pool.lookup(res.key) is None
        elif op < 0.72:
            slot = pool.lookup(rng.choice(keys))
            if slot is not None:
                pool.pin(slot)
                pins.append(slot)
        elif op < 0.84 and pins:
            pool.unpin(pins.pop(rng.randrange(len(pins))))
        elif op < 0.88:
            pool.touch(rng.choice(keys))
        elif op < 0.92:
            pool.record_hit(rng.choice(keys))
        elif op < 0.98:
            key = rng.choice(keys)
            slot = pool.lookup(key)
            dropped = pool.evict(key)
            assert dropped == (slot is not None and pool.pin_count(slot) == 0)
        else:
            pool.clear()
        pool.check_integrity()
        assert pool.num_pinned == len(set(pins))
        assert pool.num_reserved == len(pending)
    s = pool.stats()
    assert s.published_total > 0 and s.evicted_total > 0 and s.skipped_total > 0
    assert s.aborted_total > 0 and s.duplicate_total > 0 and evicted
    for res in pending:
        pool.abort(res)
    for slot in pins:
        pool.unpin(slot)
    pool.clear()
    pool.check_integrity()
    assert pool.num_free_slots == pool.num_slots
    assert pool.num_published == pool.num_reserved == pool.num_pinned == 0

"""`reset_prefix_cache` on the logical cache: the manager with host and disk tiers behind a tiny
device pool, driven through the real scheduler on the fake device and mover of test_tiers.py (every
restore checked against the request's tokens), with resets at random steps while transfers are in
flight."""

from __future__ import annotations

import random

import pytest

from hybridserve.cache.block_pool import BlockPool
from hybridserve.cache.manager import JointCacheManager
from hybridserve.cache.policy import make_policy
from hybridserve.cache.snapshots import SnapshotPool
from hybridserve.cache.state_slots import StateSlotPool
from hybridserve.cache.tiers import TieredCache, TierSpec
from hybridserve.config import POLICY_NAMES, SchedulerConfig
from hybridserve.engine.scheduler import Scheduler
from tests.cache.test_tiers import (
    BLOCK,
    COST,
    SIZES,
    FakeDevice,
    FakeEngine,
    FakeMover,
    _entry,
    _request,
    _seed_device,
    _tiers,
    _workload,
)


def _engine(policy: str, mover: FakeMover, device: FakeDevice, write_through: bool) -> FakeEngine:
    entry = SIZES.state_bytes + 3 * SIZES.kv_block_bytes
    tiers = _tiers(4 * entry, 16 * entry, mover, write_through)
    manager = JointCacheManager(BLOCK, BlockPool(96), StateSlotPool(4), SnapshotPool(2),
                                make_policy(policy, BLOCK, COST, 32), tiers=tiers)
    return FakeEngine(Scheduler(SchedulerConfig(max_num_seqs=4, max_prefill_tokens_during_decode=0), manager), device)


def _assert_empty(manager: JointCacheManager, lower_tiers: bool) -> None:
    """Nothing cached is left on the device; with `lower_tiers`, no tier entry but those a promotion
    in flight still reads."""
    assert manager.snapshots is not None and manager.snapshots.num_published == 0
    assert manager.block_pool.num_cached_free_blocks == 0
    assert all(boundary.tier != "device" for boundary in manager.joint_boundaries())
    if lower_tiers:
        assert manager.tiers is not None
        assert sum(stats.entries for stats in manager.tiers.stats()) <= len(manager.tiers.pending_promotions())


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("write_through", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_resets_between_steps_never_corrupt_or_leak(policy: str, write_through: bool, seed: int) -> None:
    """Four requests in flight, transfers that take a few steps and sometimes fail; every few steps
    a reset (device only or every tier; running requests refused or preempted). A refused reset
    changes nothing; an accepted one leaves no device snapshot, no cached free block and (every tier)
    no tier entry but those promotions still read; restores stay exact and integrity holds after
    every step; every request finishes."""
    rng = random.Random(f"{policy}-{write_through}-{seed}")
    device = FakeDevice()
    mover = FakeMover(device, delay=2, fail_rate=0.05, seed=5)
    engine = _engine(policy, mover, device, write_through)
    scheduler, manager = engine.scheduler, engine.scheduler.cache
    pending = list(_workload(11, 60))
    refused = accepted = 0
    while pending or scheduler.has_unfinished():
        while pending and len(scheduler.waiting) + len(scheduler.running) < 4:
            name, prompt, outputs = pending.pop(0)
            scheduler.add(_request(name, prompt, outputs))
        engine.step()
        if rng.random() < 0.2:
            lower_tiers = rng.random() < 0.5
            if scheduler.running and refused <= accepted:
                before = (manager.snapshots.num_published, manager.block_pool.num_cached_free_blocks)
                assert not manager.reset_prefix_cache(lower_tiers)
                assert before == (manager.snapshots.num_published, manager.block_pool.num_cached_free_blocks)
                refused += 1
            else:
                scheduler.preempt_all()
                assert manager.reset_prefix_cache(lower_tiers)
                _assert_empty(manager, lower_tiers)
                accepted += 1
            scheduler.check_integrity()
    for _ in range(4):  # let discarded promotions and queued writes settle
        engine.step()
    assert refused > 0 and accepted > 0
    assert len(engine.hits) == 60 and not manager.tiers.pending_promotions()  # type: ignore[union-attr]


def test_a_promotion_in_flight_at_a_reset_is_dropped_when_it_lands() -> None:
    """After a reset of the device alone, a second turn's state comes up from the host tier; every
    tier is reset while it is on its way: the transfer completes, nothing of it is published, its
    tier entry goes, and the request runs cold."""
    device = FakeDevice()
    mover = FakeMover(device, delay=3)
    engine = _engine("hybridserve", mover, device, write_through=True)
    scheduler, manager = engine.scheduler, engine.scheduler.cache
    first = list(range(100, 164))
    scheduler.add(_request("a", first, 2))
    while scheduler.has_unfinished():
        engine.step()
    for _ in range(6):  # the write-through copies land in the host tier
        engine.step()
    assert manager.tiers is not None and manager.tiers.stats()[0].entries > 0
    assert manager.reset_prefix_cache(lower_tiers=False)  # the device forgets; the host tier keeps them
    _assert_empty(manager, lower_tiers=False)
    assert manager.tiers.stats()[0].entries > 0
    scheduler.add(_request("b", first + [1000 + 64 % 7, 1000 + 65 % 7] + list(range(300, 340)), 1))
    engine.step()
    pending = manager.tiers.pending_promotions()
    assert pending, "the second turn should wait for its promotion"
    key = manager.tiers.ticket_entry(pending[0]).key
    assert manager.reset_prefix_cache(lower_tiers=True)
    assert manager.reset_prefix_cache(lower_tiers=False)  # a second one before it lands keeps the first's scope
    scheduler.check_integrity()
    while scheduler.has_unfinished():
        engine.step()
    assert engine.hits["b"] == 0
    assert not manager.tiers.pending_promotions()
    assert manager.tiers.find(key) is None and manager.snapshots is not None and manager.snapshots.lookup(key) is None


def test_a_reset_deletes_local_tier_objects_and_only_forgets_a_shared_tier() -> None:
    """Every tier's books empty after `TieredCache.reset`; the host store's objects are deleted, the
    shared store's stay (other replicas may use them)."""
    device, tokens = FakeDevice(), list(range(48))
    mover = FakeMover(device)
    tiers = TieredCache([TierSpec("host", 10**6), TierSpec("remote", 10**6, shared=True)], SIZES, mover)
    entry = _entry(tokens)
    blocks = _seed_device(device, entry, tokens, 0)
    tiers.publish(entry, 0, blocks.get)  # written through to the shared tier
    tiers.demote(entry, 0, blocks.get)   # and demoted to the host tier
    tiers.poll()
    assert [stats.entries for stats in tiers.stats()] == [1, 1]
    assert tiers.reset() == 2
    assert [stats.entries for stats in tiers.stats()] == [0, 0]
    assert mover.stores["host"] == {} and len(mover.stores["remote"]) == 4  # a state and three KV blocks
    tiers.check_integrity()

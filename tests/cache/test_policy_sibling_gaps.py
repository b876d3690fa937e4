"""hybridserve learns how soon the snapshot where one continuation left a turn (the request end it
restored, or the resume it captured where that end was gone) is wanted again by a sibling
continuation (an agent's branch, a regenerated chat turn), and keeps such a snapshot from insurance
marks while at least half of those siblings are still to come."""

from __future__ import annotations

import pytest

from hybridserve.cache.policy import KIND_GAPS_NEEDED, HybridServePolicy, SiblingGaps
from hybridserve.cache.snapshots import ReserveStatus, SnapshotPool
from tests.helpers.policy_pools import policy_and_pool, publish, replay_with_default


def test_an_end_is_held_while_idle_no_longer_than_the_median_sibling_gap() -> None:
    gaps = SiblingGaps()
    for _ in range(KIND_GAPS_NEEDED - 1):
        gaps.restored(0.5)
    assert not gaps.holds(0.0)                                         # too few gaps to hold anything
    for _ in range(KIND_GAPS_NEEDED):
        gaps.restored(4.0)
    assert gaps.holds(0.5) and gaps.holds(4.0)                         # the median is 4.0 (31 gaps)
    assert not gaps.holds(4.5)


def test_a_covered_end_evicted_then_continued_is_a_gap() -> None:
    """(The ghosts' bounds are `Ghosts`', tested with the reuse curves.)"""
    gaps = SiblingGaps()
    gaps.evicted(b"end", last_use=100, num_slots=10)
    gaps.missed(b"other", clock=130, num_slots=10)                     # never evicted here: no gap
    gaps.missed(b"end", clock=130, num_slots=10)                       # 3 turnovers after its last use
    assert gaps.gaps() == [3.0]


def test_sibling_points_are_ends_restored_once_and_resumes_not_restored_yet() -> None:
    assert SiblingGaps.is_sibling_point("end", 1) and SiblingGaps.is_sibling_point("resume", 0)
    assert not SiblingGaps.is_sibling_point("end", 0)                  # a continuation restores an end
    assert not SiblingGaps.is_sibling_point("resume", 1)
    assert not SiblingGaps.is_sibling_point("interval", 1)


def _covered_end(policy: HybridServePolicy, pool: SnapshotPool, kinds: dict[bytes, str], kind: str = "end") -> int:
    """Publish a request end (restored once) or a resume (`kind`) and its continuation's snapshot
    under it: it is covered. Its slot."""
    end = publish(policy, pool, kinds, b"end", 1000, kind)
    if kind == "end":
        policy.observe_restore("end", 0, b"end")
        pool.record_hit(b"end")
    child = pool.reserve(b"child", 1500, parent=b"end")
    assert child.status is ReserveStatus.RESERVED
    kinds[b"child"] = "interval"
    pool.publish(child)
    assert pool.is_covered(b"end")
    return end


@pytest.mark.parametrize("kind", ["end", "resume"])
def test_an_insurance_mark_passes_over_a_young_sibling_point_once_siblings_are_learned(kind: str) -> None:
    policy, pool, kinds = policy_and_pool(2)
    end = _covered_end(policy, pool, kinds, kind)
    assert pool.choose_covered is not None
    assert pool.choose_covered(pool) == end                            # nothing learned: the oldest covered
    for _ in range(KIND_GAPS_NEEDED):
        policy.sibling_gaps.restored(1.0)                              # siblings come within a turnover
    assert pool.choose_covered(pool) is None
    assert pool.reserve(b"mark", 512, opportunistic=True).status is ReserveStatus.SKIPPED
    for _ in range(4):
        pool.touch(b"child")                                           # the end idle 2 turnovers
    assert pool.choose_covered(pool) == end
    assert pool.reserve(b"mark", 512, opportunistic=True).evicted_key == b"end"
    pool.check_integrity()


def test_a_sibling_restore_reaches_the_policy_through_the_manager() -> None:
    """A turn, a continuation that restores its end (and covers it with its own snapshots), then a
    sibling continuation of the same turn: the second restore of the covered end is a sibling gap."""
    run, policy = replay_with_default(16, 64)
    first, output = list(range(100, 300)), [5, 6, 7]
    run.serve("0", first, output)
    run.serve("1", first + output + list(range(900, 1000)), [8])
    assert policy.sibling_gaps.gaps() == []
    run.serve("2", first + output + list(range(2000, 2100)), [9])
    assert len(policy.sibling_gaps.gaps()) == 1
    run.scheduler.check_integrity()


def test_an_eviction_takes_another_covered_slot_before_a_sibling_point_a_sibling_may_want() -> None:
    """Covered snapshots go first, the oldest first; a sibling point that a sibling may still want
    goes after the other covered ones, but still before anything that serves on its own."""
    policy, pool, kinds = policy_and_pool(4)
    end = _covered_end(policy, pool, kinds)                            # oldest: a covered sibling point
    mark = publish(policy, pool, kinds, b"mark", 256, "interval")
    under = pool.reserve(b"deeper", 512, parent=b"mark")
    assert under.status is ReserveStatus.RESERVED
    kinds[b"deeper"] = "end"
    pool.publish(under)
    assert pool.is_covered(b"mark") and pool.num_free_slots == 0
    assert pool.choose_victim is not None
    assert pool.choose_victim(pool) == end                             # nothing learned: the oldest covered
    for _ in range(KIND_GAPS_NEEDED):
        policy.sibling_gaps.restored(1.0)                              # siblings come within a turnover
    assert pool.choose_victim(pool) == mark
    assert pool.reserve(b"next", 2000).evicted_key == b"mark"
    assert pool.choose_victim(pool) == end                             # the only covered slot left
    pool.check_integrity()

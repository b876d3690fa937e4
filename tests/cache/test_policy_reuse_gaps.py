"""hybridserve learns, per candidate kind, how long unreused snapshots sit idle before they are first
wanted (restored, or an evicted request end continued), and values an unreused snapshot by the
share of those gaps still ahead of it."""

from __future__ import annotations

from hybridserve.cache.policy import GHOSTS_PER_SLOT, KIND_GAPS_KEPT, KIND_GAPS_NEEDED, ReuseGaps
from tests.helpers.policy_pools import policy_and_pool, publish, replay_with_default


def test_a_kind_gets_a_curve_after_enough_gaps_and_keeps_the_latest() -> None:
    gaps = ReuseGaps()
    for gap in range(KIND_GAPS_NEEDED - 1):
        gaps.add("end", float(gap))
    assert gaps.curves() == {}
    gaps.add("end", 100.0)
    assert gaps.curves()["end"] == [*map(float, range(KIND_GAPS_NEEDED - 1)), 100.0]
    for _ in range(KIND_GAPS_KEPT):                                    # old gaps age out, the order holds
        gaps.add("end", 7.0)
    assert gaps.curves()["end"] == [7.0] * KIND_GAPS_KEPT
    assert gaps.gaps("branch") == []


def test_an_evicted_end_continued_later_is_a_gap_counted_once() -> None:
    gaps = ReuseGaps()
    gaps.end_evicted(b"end", last_use=100, num_slots=10)
    gaps.end_missed(b"end", clock=400, num_slots=10)                   # 30 turnovers after its last use
    gaps.end_missed(b"end", clock=900, num_slots=10)
    gaps.end_missed(b"other", clock=900, num_slots=10)                 # never evicted here: no gap
    assert gaps.gaps("end") == [30.0]
    for index in range(GHOSTS_PER_SLOT + 1):                           # ghosts are bounded per slot
        gaps.end_evicted(f"e{index}".encode(), last_use=0, num_slots=1)
    gaps.end_missed(b"e0", clock=10, num_slots=1)
    assert gaps.gaps("end") == [30.0]


def test_an_end_idle_past_every_reuse_gap_goes_before_a_shallower_young_one() -> None:
    policy, pool, kinds = policy_and_pool(2)
    old = publish(policy, pool, kinds, b"old", 2048, "end")
    young = publish(policy, pool, kinds, b"young", 1024, "end")
    for _ in range(12):
        pool.touch(b"young")                                           # "old" idle 6.5 turnovers
    assert pool.choose_victim is not None
    assert pool.choose_victim(pool) == young                           # by the age horizon: deeper wins
    for _ in range(KIND_GAPS_NEEDED):
        policy.reuse_gaps.add("end", 1.0)                              # ends are wanted within a turnover
    assert pool.choose_victim(pool) == old


def test_a_continued_evicted_end_reaches_the_policy_through_the_manager() -> None:
    """Two-slot pool: a first turn's end is evicted by later requests' snapshots, then its next
    turn continues it; the manager reports the missed end and the policy counts its gap."""
    run, policy = replay_with_default(2, 256)
    first, output = list(range(100, 300)), [5, 6, 7]
    run.serve("0", first, output)
    for turn in range(1, 4):
        run.serve(str(turn), [10_000 * turn + offset for offset in range(200)], [5, 6, 7])
    depths = [tokens for _, _, tokens, *_ in run.snapshots.candidates(8)]
    assert len(first) + len(output) not in depths                      # the first turn's end is gone
    run.serve("4", first + output + list(range(900, 1000)), [8])
    assert len(policy.reuse_gaps.gaps("end")) == 1
    run.scheduler.check_integrity()

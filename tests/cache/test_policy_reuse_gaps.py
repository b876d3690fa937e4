"""hybridserve learns, per candidate kind, how long unreused snapshots sit idle before they are first
wanted (restored, or an evicted request end continued) and how long restored ones sit idle before
they are wanted again (restored, or passed on a later request's path after eviction), and values a
snapshot by the share of those gaps still ahead of it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hybridserve import SamplingParams
from hybridserve.cache.policy import (
    CANDIDATE_KINDS,
    FIRST_RATE_MAX,
    GHOSTS_PER_SLOT,
    KIND_GAPS_KEPT,
    KIND_GAPS_NEEDED,
    PREMATURE_TURNOVERS,
    ReuseGaps,
)
from hybridserve.engine.request import Request
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


@pytest.mark.parametrize("restored", [False, True])
def test_an_end_idle_past_every_reuse_gap_goes_before_a_shallower_young_one(restored: bool) -> None:
    """Unreused ends are valued by the gaps before a first reuse, restored ones by those before a
    later one (each curve alone: the other kind of gap does not move them). Few ends are ever
    wanted here (see the next test for where nearly all are)."""
    policy, pool, kinds = policy_and_pool(2)
    old = publish(policy, pool, kinds, b"old", 2048, "end")
    young = publish(policy, pool, kinds, b"young", 1024, "end")
    for _ in range(50 * KIND_GAPS_NEEDED):
        policy.reuse_gaps.published("end")
    for key in (b"old", b"young") if restored else ():
        pool.record_hit(key)
    for _ in range(12):
        pool.touch(b"young")                                           # "old" idle 6 turnovers or more
    assert pool.choose_victim is not None
    for _ in range(KIND_GAPS_NEEDED):                                  # the other curve: no effect
        (policy.reuse_gaps.add if restored else policy.reuse_gaps.add_repeat)("end", 1.0)
    assert pool.choose_victim(pool) == young                           # by the age horizon: deeper wins
    for _ in range(KIND_GAPS_NEEDED):                                  # ends are wanted within a turnover
        (policy.reuse_gaps.add_repeat if restored else policy.reuse_gaps.add)("end", 1.0)
    assert pool.choose_victim(pool) == old


def test_the_share_of_a_kind_ever_wanted_counts_first_reuses_over_publications() -> None:
    gaps = ReuseGaps()
    gaps.add("end", 0.5)
    assert gaps.first_rate("end") == 0.0                               # nothing published yet
    for _ in range(KIND_GAPS_NEEDED):
        gaps.published("end")
    assert gaps.first_rate("end") == pytest.approx(1 / KIND_GAPS_NEEDED, rel=1e-2)
    for _ in range(2 * KIND_GAPS_NEEDED):
        gaps.add("end", 0.5)
    assert gaps.first_rate("end") == FIRST_RATE_MAX                   # more wants than publications: capped
    assert gaps.first_rate("branch") == 0.0


@pytest.mark.parametrize(("publications", "victim"), [(50 * KIND_GAPS_NEEDED, "old"), (KIND_GAPS_NEEDED, "young")])
def test_an_idle_unreused_end_keeps_its_chance_where_nearly_every_end_is_wanted(publications: int,
                                                                               victim: str) -> None:
    """An unreused snapshot is valued by the chance that it is still wanted given that it has not
    been yet. Where few ends are ever wanted, one idle past every gap seen is unlikely to be and
    goes before a young shallower one; where nearly all are, it is still likely to be and stays."""
    policy, pool, kinds = policy_and_pool(2)
    slots = {"old": publish(policy, pool, kinds, b"old", 2048, "end"),
             "young": publish(policy, pool, kinds, b"young", 1024, "end")}
    for _ in range(12):
        pool.touch(b"young")                                           # "old" idle 6 turnovers
    for _ in range(publications - 2):
        policy.reuse_gaps.published("end")
    for _ in range(KIND_GAPS_NEEDED):
        policy.reuse_gaps.add("end", 1.0)                              # ends are wanted within a turnover
    assert pool.choose_victim is not None
    assert pool.choose_victim(pool) == slots[victim]


def test_a_continued_evicted_end_reaches_the_policy_through_the_manager() -> None:
    """Two-slot pool: a first turn's end is evicted by later requests' snapshots, then its next
    turn continues it; the manager reports the missed end and the policy counts its gap."""
    run, policy = replay_with_default(2, 256)
    first, output = list(range(100, 300)), [5, 6, 7]
    run.serve("0", first, output)
    for turn in range(1, 4):
        run.serve(str(turn), [10_000 * turn + offset for offset in range(250)], [5, 6, 7])
    depths = [tokens for _, _, tokens, *_ in run.snapshots.candidates(8)]
    assert len(first) + len(output) - 1 not in depths                  # the first turn's end is gone
    run.serve("4", first + output + list(range(900, 1000)), [8])
    assert len(policy.reuse_gaps.gaps("end")) == 1
    run.scheduler.check_integrity()


def test_a_reused_snapshot_passed_on_a_later_path_is_a_repeat_gap() -> None:
    gaps = ReuseGaps()
    gaps.reused_evicted("resume", b"deep", last_use=100, num_slots=10)
    gaps.reused_evicted("end", b"shallow", last_use=50, num_slots=10)

    def path() -> Iterator[bytes]:
        yield from (b"never evicted", b"deep")
        raise AssertionError("walked past the deepest remembered snapshot")

    gaps.missed_on_path(path(), clock=300, num_slots=10)                # only the deepest counts
    assert gaps.gaps("resume", repeat=True) == [20.0]
    assert gaps.gaps("end", repeat=True) == []
    gaps.missed_on_path([b"deep", b"shallow"], clock=400, num_slots=10)  # "deep" is forgotten now
    assert gaps.gaps("end", repeat=True) == [35.0]
    assert gaps.gaps("resume") == gaps.gaps("end") == []                # first-reuse curves apart


def test_a_reused_end_wanted_after_eviction_reaches_the_policy_through_the_manager() -> None:
    """Two-slot pool: a first turn's end is restored by its next turn, evicted by later requests'
    snapshots, then a second continuation of the first turn passes it: a repeat gap for ends."""
    run, policy = replay_with_default(2, 256)
    first, output = list(range(100, 300)), [5, 6, 7]
    run.serve("0", first, output)
    run.serve("1", first + output + list(range(900, 1000)), [8])      # restores the first end
    assert policy.reuse_gaps.gaps("end", repeat=True) == []
    for turn in range(2, 5):
        run.serve(str(turn), [10_000 * turn + offset for offset in range(250)], [5, 6, 7])
    depths = [tokens for _, _, tokens, *_ in run.snapshots.candidates(8)]
    assert len(first) + len(output) - 1 not in depths                  # the first turn's end is gone
    run.serve("5", first + output + list(range(2000, 2100)), [8])
    assert len(policy.reuse_gaps.gaps("end", repeat=True)) == 1
    run.scheduler.check_integrity()


def test_the_walk_beyond_a_depth_yields_cached_boundaries_deepest_first() -> None:
    """After a 203-token request (block 16; its end state is at 202, the last token is never fed), a
    longer prompt through it passes the cached tail at 202, then the ends of full blocks, down to
    (not including) the depth asked."""
    run, _ = replay_with_default(2, 256)
    first = list(range(100, 303))
    run.serve("0", first[:200], first[200:])
    probe = Request("probe", None, first + list(range(900, 1000)), SamplingParams(max_tokens=1))
    hashes = run.cache.block_hashes(probe, len(probe.token_ids) // 16)
    assert run.cache.prefix_cache is not None
    kv_match = len(run.blocks.longest_cached_prefix(hashes)) * 16
    assert kv_match == 192                                             # the first request's full blocks
    walk = run.cache.prefix_cache.boundaries_beyond(hashes, probe.token_ids, (), 160, kv_match,
                                                    run.cache.block_hash)
    assert list(walk) == [run.cache.boundary_key(probe, 202), hashes[11], hashes[10]]


def test_only_where_a_conversation_left_off_learns_a_repeat_curve() -> None:
    """A restored end or resume is wanted again as its conversation goes on; a restored shared
    prefix (a mark, a branch point) as often as it is popular, which the age horizon weighs."""
    policy, pool, kinds = policy_and_pool(4)
    for key, kind in ((b"end", "end"), (b"resume", "resume"), (b"mark", "interval"), (b"branch", "branch")):
        publish(policy, pool, kinds, key, 1024, kind)
        policy.observe_restore(kind, 1, key)                           # a second restore
    assert [kind for kind in CANDIDATE_KINDS + ("resume",) if policy.reuse_gaps.gaps(kind, repeat=True)] == [
        "end", "resume"]


def test_the_walk_reports_a_never_restored_resume_deeper_than_the_reused_snapshot_it_stops_at() -> None:
    gaps = ReuseGaps()
    gaps.resume_evicted(b"fresh deep", last_use=280, num_slots=10)
    gaps.reused_evicted("end", b"reused", last_use=100, num_slots=10)
    gaps.resume_evicted(b"fresh shallow", last_use=290, num_slots=10)
    found = gaps.missed_on_path([b"fresh deep", b"reused", b"fresh shallow"], clock=300, num_slots=10)
    assert found == 2.0                                                # idle 2 turnovers; a resume is no gap
    assert gaps.gaps("end", repeat=True) == [20.0]                     # the reused one still counts
    assert gaps.gaps("resume") == gaps.gaps("resume", repeat=True) == []
    assert gaps.missed_on_path([b"fresh shallow"], clock=300, num_slots=10) == 1.0  # not walked to before
    assert gaps.missed_on_path([b"fresh deep", b"fresh shallow"], clock=300, num_slots=10) is None


@pytest.mark.parametrize(("later_uses", "counted"), [(0, True), (1, False)])
def test_a_resume_evicted_too_early_and_wanted_counts_as_a_restore_of_resumes(later_uses: int, counted: bool) -> None:
    """A covered resume goes first, so resumes would never show the restores that would make them
    branch points; one wanted on a later path within a pool turnover of its last use counts."""
    policy, pool, kinds = policy_and_pool(1)
    publish(policy, pool, kinds, b"resume", 1024, "resume")
    publish(policy, pool, kinds, b"next", 2048, "end")                # one slot: the resume is evicted
    for _ in range(later_uses):
        pool.touch(b"next")                                            # one more tick: idle 2 turnovers
    restores = policy.kind_rates.evidence("resume")[0]
    policy.observe_missed_path(iter([b"not remembered", b"resume"]))
    assert (1 + later_uses <= PREMATURE_TURNOVERS) == counted           # idle turnovers (one slot)
    assert policy.kind_rates.evidence("resume")[0] == pytest.approx(restores + (1.0 if counted else 0.0))


def _sibling_resume_restores(walk: bool) -> float:
    """Two-slot pool: a turn's end is evicted, so its continuation captures a resume where it ended;
    the continuation's own snapshots push that resume out; a sibling continuation then passes it.
    The restores of resumes the policy counts by then."""
    run, policy = replay_with_default(2, 256)
    policy.learns_from_paths = walk
    first, output = list(range(100, 300)), [5, 6, 7]
    run.serve("0", first, output)
    for turn in range(1, 4):
        run.serve(str(turn), [10_000 * turn + offset for offset in range(250)], [5, 6, 7])
    run.serve("4", first + output + list(range(900, 1000)), [8])
    assert policy.kind_rates.evidence("resume")[1] > 0                 # the resume was captured
    depths = [tokens for _, _, tokens, *_ in run.snapshots.candidates(8)]
    assert 192 not in depths                                           # and is gone (block 16)
    run.serve("5", first + output + list(range(2000, 2100)), [9])
    run.scheduler.check_integrity()
    return policy.kind_rates.evidence("resume")[0]


def test_a_sibling_passing_an_evicted_resume_counts_a_restore_through_the_manager() -> None:
    assert _sibling_resume_restores(walk=True) == pytest.approx(_sibling_resume_restores(walk=False) + 1.0, abs=0.01)

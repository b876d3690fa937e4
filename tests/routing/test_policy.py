"""choose_replica: deepest useful hit, load fallback, no hit; OutstandingWork's counts."""

from __future__ import annotations

import pytest

from hybridserve.routing.policy import (
    JOINT_HIT,
    LOAD_FALLBACK,
    NO_HIT,
    OutstandingWork,
    RouterConfig,
    RoutingDecision,
    choose_replica,
)

CONFIG = RouterConfig(min_hit_tokens=64, min_hit_share=0.1, hit_weight=1.0, hit_bonus=1000.0, max_load_ratio=1.5)


def test_the_deepest_useful_hit_wins_under_even_load() -> None:
    depths = {"a": 0, "b": 900, "c": 500}
    loads = {"a": 0.0, "b": 100.0, "c": 0.0}
    assert choose_replica(depths, loads, 1000, CONFIG) == RoutingDecision("b", JOINT_HIT)


def test_no_useful_hit_goes_to_the_least_loaded() -> None:
    loads = {"a": 50.0, "b": 10.0, "c": 30.0}
    assert choose_replica({}, loads, 1000, CONFIG) == RoutingDecision("b", NO_HIT)
    assert choose_replica({"a": 60}, loads, 1000, CONFIG) == RoutingDecision("b", NO_HIT)     # under 64 tokens
    assert choose_replica({"a": 90}, loads, 1000, CONFIG) == RoutingDecision("b", NO_HIT)     # under 10 %
    assert choose_replica({"a": 90}, loads, 500, CONFIG) == RoutingDecision("a", JOINT_HIT)   # 18 % of 500


def test_an_overloaded_hit_replica_falls_back() -> None:
    depths = {"a": 900, "b": 0, "c": 0}
    # the queue in front of the hit outweighs what it saves plus the bonus
    assert choose_replica(depths, {"a": 2000.0, "b": 0.0, "c": 50.0}, 1000, CONFIG) == \
        RoutingDecision("b", LOAD_FALLBACK)
    # a small queue does not
    assert choose_replica(depths, {"a": 1500.0, "b": 0.0, "c": 50.0}, 1000, CONFIG).reason == JOINT_HIT
    # far above the mean: never chosen for its hit, however deep
    deep = {"a": 100_000, "b": 0, "c": 0}
    busy = {"a": 30_000.0, "b": 9_000.0, "c": 9_000.0}
    assert choose_replica(deep, busy, 200_000, CONFIG).reason == LOAD_FALLBACK
    # a shallower hit on a quiet replica is the fallback of choice
    assert choose_replica({"a": 900, "b": 600, "c": 0}, {"a": 5000.0, "b": 0.0, "c": 0.0}, 1000, CONFIG) == \
        RoutingDecision("b", LOAD_FALLBACK)


def test_ties_rotate_with_the_turn_and_depths_are_capped_by_the_prompt() -> None:
    loads = {"a": 0.0, "b": 0.0, "c": 0.0}
    assert [choose_replica({}, loads, 100, CONFIG, turn).replica for turn in range(4)] == ["a", "b", "c", "a"]
    assert choose_replica({"a": 500, "b": 500}, loads, 1000, CONFIG, turn=1).replica == "b"
    # a depth reported past the prompt counts as prompt - 1
    assert choose_replica({"a": 5000, "b": 999}, {"a": 0.0, "b": 0.0}, 1000, CONFIG).reason == JOINT_HIT
    with pytest.raises(ValueError, match="no replica"):
        choose_replica({}, {}, 10, CONFIG)
    with pytest.raises(ValueError):
        RouterConfig(max_load_ratio=0.5)


def test_outstanding_work_counts_routed_requests_until_they_end() -> None:
    work = OutstandingWork()
    work.add_replica("a")
    work.start("r1", "a", 100.0)
    work.start("r2", "b", 40.0)
    work.start("r3", "a", 10.0)
    assert work.loads() == {"a": 110.0, "b": 40.0}
    work.finish("r1")
    work.finish("missing")
    assert work.loads() == {"a": 10.0, "b": 40.0}
    work.remove_replica("b")
    work.finish("r2")
    assert work.loads() == {"a": 10.0}


def test_outstanding_work_with_a_half_life_remembers_recent_work() -> None:
    now = [0.0]
    work = OutstandingWork(half_life=10.0, clock=lambda: now[0])
    work.start("r1", "a", 100.0)
    work.finish("r1")
    work.add_replica("b")
    assert work.loads() == {"a": 100.0, "b": 0.0}   # finished, but sent just now
    now[0] = 10.0
    assert work.loads() == {"a": pytest.approx(50.0), "b": 0.0}
    work.start("r2", "b", 30.0)
    now[0] = 20.0
    assert work.loads() == {"a": pytest.approx(25.0), "b": pytest.approx(30.0 + 15.0)}
    with pytest.raises(ValueError):
        OutstandingWork(half_life=-1.0)

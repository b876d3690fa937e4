"""`hybridserve sim --replicas N`: routed replays on small generated workloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridserve.cli import main
from hybridserve.routing.policy import RouterConfig
from hybridserve.sim.routing import SINGLE, RoutingSimConfig, conversation_roots, simulate_routing, split_budgets
from hybridserve.sim.shapes import model_shape
from hybridserve.sim.simulator import AccountingRun, SimConfig, simulate
from hybridserve.sim.trace import TraceTokens
from hybridserve.sim.workloads import workload_records

SHAPE = model_shape("builtin")
BLOCK_TOKENS = 16
SCALED = RouterConfig(min_hit_tokens=16, hit_bonus=128.0)  # these workloads are 32x shorter than unscaled


def _tokens(name: str = "chat", count: int = 240) -> TraceTokens:
    return TraceTokens(workload_records(name, count, BLOCK_TOKENS, seed=3), BLOCK_TOKENS, SHAPE.config.vocab_size)


def _cache(slots: int) -> SimConfig:
    """Budgets of `slots` snapshots in total and a KV pool far larger than the workload."""
    return SimConfig("hybridserve", 1 << 30, slots * SHAPE.cost.snapshot_bytes + 1, 16, 32)


def test_one_replica_replays_exactly_as_the_plain_simulator() -> None:
    routed = simulate_routing(_tokens(), SHAPE, RoutingSimConfig(_cache(12), 1, SINGLE))
    plain = simulate(_tokens(), SHAPE, _cache(12))
    assert routed.hit_tokens == plain.hit_tokens > 0 and routed.prompt_tokens == plain.prompt_tokens
    assert routed.balance == 1.0 and set(routed.routes) == {0}


def test_budgets_are_split_evenly() -> None:
    config = _cache(40)._replace(host_bytes=4000, disk_bytes=8000)
    share = split_budgets(config, 4)
    assert (share.kv_bytes, share.snapshot_bytes, share.host_bytes, share.disk_bytes) == (
        config.kv_bytes // 4, config.snapshot_bytes // 4, 1000, 2000)
    assert AccountingRun(share, SHAPE).snapshot_slots == 10


def test_routers_place_requests_as_they_say() -> None:
    tokens = _tokens()
    configs = {router: RoutingSimConfig(_cache(40), 4, router, 0.0, router_config=SCALED)
               for router in ("round-robin", "least-load", "session", "joint")}
    results = {router: simulate_routing(tokens, SHAPE, config, check=True) for router, config in configs.items()}
    assert results["round-robin"].routes[:8] == (0, 1, 2, 3, 0, 1, 2, 3)
    roots: dict[int, int] = {}
    by_conversation: dict[int, set[int]] = {}
    for index, replica in enumerate(results["session"].routes):
        by_conversation.setdefault(conversation_roots(tokens, index, roots), set()).add(replica)
    assert all(len(replicas) == 1 for replicas in by_conversation.values()) and len(by_conversation) > 4
    assert len(set(results["session"].routes)) > 1  # conversations spread (by hash: not necessarily evenly)
    joint = results["joint"]
    # summaries refreshed before every request: the router saw exactly the hit each request got
    assert joint.predicted_exact == 1.0
    assert dict(joint.reasons)["joint_hit"] > 0
    assert joint.hit_rate > results["round-robin"].hit_rate and joint.hit_rate > results["least-load"].hit_rate
    for result in results.values():
        assert sum(result.work) > 0 and result.requests == 240


def test_stale_summaries_still_route_and_are_counted() -> None:
    stale = simulate_routing(_tokens(), SHAPE, RoutingSimConfig(_cache(40), 4, "joint", 1e9, router_config=SCALED))
    assert dict(stale.reasons).get("joint_hit", 0) == 0  # one summary, taken before anything was cached
    assert stale.predicted_exact < 1.0


def test_sim_command_with_replicas(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "routed.json"
    code = main(["sim", "--workload", "agent", "--num-requests", "150", "--model-shape", "builtin",
                 "--snapshot-budgets-gib", "0.01", "--kv-budgets-gib", "1", "--block-size", "16",
                 "--snapshot-interval", "32", "--block-tokens", "16", "--replicas", "3",
                 "--router", "round-robin,joint", "--json", str(out), "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "columns:" in printed and "max/mean work" in printed
    report = json.loads(out.read_text())
    assert [(row["router"], row["replicas"]) for row in report["rows"]] == [
        ("single", 1), ("round-robin", 3), ("joint", 3)]
    assert report["rows"][0]["of_single"] == 1.0
    assert all(row["work_max_over_mean"] >= 1.0 for row in report["rows"])


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "2", "--router", "random"], "unknown router"),
    (["--replicas", "2", "--snapshot-budgets-gib", "1,2"], "one --snapshot-budgets-gib"),
    (["--replicas", "0"], "--replicas must be >= 1"),
])
def test_bad_routing_flags_are_clear_errors(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["sim", "--workload", "chat", "--num-requests", "20", "--model-shape", "builtin", "--block-size", "16",
            "--snapshot-interval", "32", "--block-tokens", "16", "--no-progress", "--snapshot-budgets-gib", "0.01"]
    code = main(base + flags) if "--snapshot-budgets-gib" not in flags else main(base[:-2] + flags)
    assert code != 0
    assert message in capsys.readouterr().err

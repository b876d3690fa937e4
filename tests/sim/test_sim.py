"""`hybridserve sim`: the whole command on a small trace, its errors, and the slot bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridserve.cli import main
from hybridserve.config import POLICY_NAMES
from hybridserve.sim.bound import hit_options, slot_bound_hit_tokens
from hybridserve.sim.simulator import ceiling_hit_tokens
from hybridserve.sim.trace import TraceRecord, TraceTokens

VOCAB = 4096


def _tokens(hash_lists: list[list[int]], input_length: int, block_tokens: int = 16) -> TraceTokens:
    records = [TraceRecord(float(i), input_length, 2, tuple(ids)) for i, ids in enumerate(hash_lists)]
    return TraceTokens(records, block_tokens, VOCAB)


def _branching_trace(path: Path) -> Path:
    """Chains that share a system prefix, fork and come back, plus one conversation."""
    records = []
    for turn in range(6):
        records.append({"timestamp": turn, "input_length": 64 * (2 + turn % 3), "output_length": 4,
                        "hash_ids": [0, 1 + turn % 3, 10 + turn % 2, 20 + turn][:2 + turn % 3]})
    records.append({"timestamp": 7, "input_length": 64, "output_length": 8, "hash_ids": [50, 51]})
    records.append({"timestamp": 8, "input_length": 200, "output_length": 8, "hash_ids": [50, 51, 52, 53, 54, 55, 56]})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _built(records: list[TraceRecord], block_tokens: int = 16) -> TraceTokens:
    tokens = TraceTokens(records, block_tokens, VOCAB)
    for index in range(len(records)):
        tokens.prompt(index)
        tokens.output(index)
    return tokens


def test_a_turn_continues_the_request_whose_full_blocks_it_starts_with() -> None:
    """A second turn starts with the first turn's prompt and output, also when the first turn added
    less than a block of its own to what it shared (a chain of short turns)."""
    records = [TraceRecord(0.0, 40, 4, (0, 1, 2)),       # full blocks (0, 1): its own
               TraceRecord(1.0, 46, 4, (0, 1, 3)),       # adds 6 tokens: no full block of its own
               TraceRecord(2.0, 52, 4, (0, 1, 4, 5))]
    tokens = _built(records)
    assert [tokens.predecessor(i) for i in range(3)] == [None, 0, 1]
    assert tokens.prompt(2)[:50] == tokens.prompt(1) + tokens.output(1)


def test_requests_that_share_only_a_long_prompt_are_not_turns_of_one_another() -> None:
    """Requests that open with one shared multi-block prompt and add less than a block: once
    SHARED_PROMPT_BRANCHES different blocks have followed that prompt, a longer one is not taken
    for the previous one's next turn (nothing in the ids tells the two apart)."""
    from hybridserve.sim.trace import SHARED_PROMPT_BRANCHES

    prompt = (46, 47, 48)
    records = [TraceRecord(float(i), 50 + i, 1, prompt + (100 + i,)) for i in range(SHARED_PROMPT_BRANCHES + 3)]
    tokens = _built(records)
    linked = [tokens.predecessor(i) for i in range(len(records))]
    assert linked[1:SHARED_PROMPT_BRANCHES] == list(range(SHARED_PROMPT_BRANCHES - 1))  # few siblings yet
    assert linked[SHARED_PROMPT_BRANCHES + 1:] == [None, None]
    # Requests whose full blocks go beyond the shared prompt still continue each other.
    own = prompt + (200, 201)
    records += [TraceRecord(20.0, 70, 1, own), TraceRecord(21.0, 80, 1, own[:4] + (202,))]
    tokens = _built(records)
    assert tokens.predecessor(len(records) - 1) == len(records) - 2


def test_slot_bound_charges_each_hit_its_stretch() -> None:
    """Six one-block prompts, each repeated three requests later: every hit holds a slot for three
    requests, so one slot over six requests pays for two hits of 15 tokens (input - 1)."""
    tokens = _tokens([[1], [2], [3], [1], [2], [3]], input_length=16)
    ceiling, _ = ceiling_hit_tokens(tokens)
    options = hit_options(tokens)
    assert ceiling == 3 * 15
    assert slot_bound_hit_tokens(options, 1) == pytest.approx(2 * 15, rel=1e-6)
    assert slot_bound_hit_tokens(options, 2) == pytest.approx(ceiling, rel=1e-6)


def test_slot_bound_is_at_most_the_ceiling_and_grows_with_slots(tmp_path: Path) -> None:
    from hybridserve.sim.trace import read_trace

    tokens = TraceTokens(read_trace(_branching_trace(tmp_path / "t.jsonl"), None, 16), 16, VOCAB)
    ceiling, _ = ceiling_hit_tokens(tokens)
    options = hit_options(tokens)
    bounds = [slot_bound_hit_tokens(options, slots) for slots in (0, 1, 2, 64)]
    assert bounds == sorted(bounds) and bounds[-1] == pytest.approx(ceiling, rel=1e-6)
    assert bounds[0] == pytest.approx(0, abs=1e-6) and bounds[1] > 0


def test_sim_command_reports_every_policy_below_its_bound(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    code = main(["sim", "--trace", str(_branching_trace(tmp_path / "t.jsonl")), "--model-shape", "builtin",
                 "--policies", ",".join(POLICY_NAMES), "--snapshot-budgets-gib", "0.002,0.05",
                 "--kv-budgets-gib", "0.01", "--block-size", "16", "--snapshot-interval", "32",
                 "--block-tokens", "16", "--json", str(out), "--no-progress"])
    assert code == 0
    report = json.loads(out.read_text())
    assert {row["policy"] for row in report["rows"]} == set(POLICY_NAMES)
    for row in report["rows"]:
        assert row["token_hit_rate"] <= row["slot_bound_token_hit_rate"] + 1e-9
        assert row["slot_bound_token_hit_rate"] <= report["ceiling_token_hit_rate"] + 1e-9
    assert max(row["token_hit_rate"] for row in report["rows"]) > 0


@pytest.mark.parametrize("flags, message", [
    (["--policies", "lru"], "unknown cache policy lru"),
    (["--snapshot-budgets-gib", "-1"], "must be positive"),
    (["--kv-budgets-gib", "lots"], "comma-separated numbers"),
    (["--snapshot-interval", "24", "--block-size", "16"], "multiple of --block-size"),
    (["--trace", "/nonexistent/trace.jsonl"], "trace"),
])
def test_sim_bad_input_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
                                        message: str) -> None:
    trace = str(_branching_trace(tmp_path / "t.jsonl"))
    argv = ["sim", "--trace", trace, "--model-shape", "builtin", "--no-progress", *flags]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_oracle_keeps_the_states_restored_soonest() -> None:
    """A, B, C, then A, B, C again (three-block prompts that end mid-block): each repeat can hit
    the prompt mark at 32 tokens. With one slot the oracle keeps A's (restored first) and skips
    B's and C's; with two it keeps A's and B's. LRU-like eviction keeps the latest marks, which
    the repeats need last, and hits nothing with one or two slots."""
    from hybridserve.sim.oracle import learn_restores, simulate_oracle
    from hybridserve.sim.shapes import model_shape
    from hybridserve.sim.simulator import SimConfig, simulate

    shape = model_shape("builtin")
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]] * 2
    config = SimConfig("hybridserve", 64 * 16 * shape.cost.kv_bytes_per_token, shape.cost.snapshot_bytes, 16, 32)
    restores = learn_restores(_tokens(prompts, input_length=40), shape, config)
    assert sorted(len(times) for times in restores.values()) == [1, 1, 1]
    hits = []
    for slots in (1, 2, 3):
        sized = config._replace(snapshot_bytes=slots * shape.cost.snapshot_bytes)
        result = simulate_oracle(_tokens(prompts, input_length=40), shape, sized, restores, check=True)
        assert result.config.policy == "oracle" and result.snapshot_slots == slots
        assert result.hits == (0, 0, 0, 32, 32 if slots > 1 else 0, 32 if slots > 2 else 0)
        hits.append(result.hit_tokens)
        online = simulate(_tokens(prompts, input_length=40), shape, sized, check=True)
        assert online.hit_tokens <= result.hit_tokens
    assert hits == [32, 64, 96]


def test_sim_oracle_rows_lie_between_the_policies_and_the_bound(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    code = main(["sim", "--trace", str(_branching_trace(tmp_path / "t.jsonl")), "--model-shape", "builtin",
                 "--policies", "hybridserve", "--snapshot-budgets-gib", "0.002,0.05", "--oracle",
                 "--kv-budgets-gib", "0.01", "--block-size", "16", "--snapshot-interval", "32",
                 "--block-tokens", "16", "--json", str(out), "--no-progress"])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    oracle = {row["snapshot_slots"]: row for row in rows if row["policy"] == "oracle"}
    online = {row["snapshot_slots"]: row for row in rows if row["policy"] == "hybridserve"}
    assert set(oracle) == set(online) == {2, 65}
    for slots, row in oracle.items():
        assert online[slots]["token_hit_rate"] <= row["token_hit_rate"] <= row["slot_bound_token_hit_rate"] + 1e-9
    assert oracle[65]["token_hit_rate"] > 0


def test_tiers_recover_what_one_device_slot_loses() -> None:
    """A, B, C, then A, B, C again with one device snapshot slot: the device alone keeps only the
    latest state and hits nothing; a host tier of about one joint entry plus a disk tier bring every
    repeat's hit back (integrity checked), the hits by tier add up, and promotions cost link time."""
    from hybridserve.sim.shapes import model_shape
    from hybridserve.sim.simulator import SimConfig, simulate

    shape = model_shape("builtin")
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]] * 2
    entry = shape.cost.snapshot_bytes + 3 * 16 * shape.cost.kv_bytes_per_token
    for policy in POLICY_NAMES:
        alone = SimConfig(policy, 64 * 16 * shape.cost.kv_bytes_per_token, shape.cost.snapshot_bytes, 16, 32)
        device = simulate(_tokens(prompts, input_length=40), shape, alone, check=True)
        tiered = simulate(_tokens(prompts, input_length=40), shape,
                          alone._replace(host_bytes=entry, disk_bytes=100 * entry), check=True)
        by_tier = dict(tiered.tier_hit_tokens)
        assert set(by_tier) == {"device", "host", "disk"} and sum(by_tier.values()) == tiered.hit_tokens
        assert tiered.hit_tokens >= device.hit_tokens
        assert (by_tier["host"] + by_tier["disk"] > 0) == (tiered.promotion_seconds > 0)
        if policy in ("hybridserve", "interval", "last-block"):  # they snapshot the prompt mark (32)
            assert device.hits == (0,) * 6 and tiered.hits == (0, 0, 0, 32, 32, 32)
            assert by_tier["device"] == 0 and by_tier["disk"] > 0  # host holds one entry: the rest fell to disk


def test_sim_command_prints_its_legend_and_tier_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    code = main(["sim", "--trace", str(_branching_trace(tmp_path / "t.jsonl")), "--model-shape", "builtin",
                 "--policies", "hybridserve", "--snapshot-budgets-gib", "0.001", "--host-budgets-gib", "0,0.01",
                 "--disk-budgets-gib", "0.1", "--kv-budgets-gib", "0.01", "--block-size", "16",
                 "--snapshot-interval", "32", "--block-tokens", "16", "--json", str(out), "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "columns:" in printed and "differ from `hybridserve serve`" in printed and "summary:" in printed
    assert printed.count("  hybridserve: best") == 1
    rows = json.loads(out.read_text())["rows"]
    assert [(row["host_budget_gib"], row["disk_budget_gib"]) for row in rows] == [
        (0, pytest.approx(0.1)), (pytest.approx(0.01), pytest.approx(0.1))]
    for row in rows:
        assert row["net_seconds_saved"] <= row["prefill_seconds_saved"]

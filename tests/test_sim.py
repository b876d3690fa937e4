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

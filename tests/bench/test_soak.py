"""`python -m benchmarks.soak`: its flags, and a shortened soak (slow): mixed random traffic against
a live `hybridserve serve` subprocess for 150 s, with overload bursts. CPU, float32."""

from __future__ import annotations

import pytest

from benchmarks.soak import SoakConfig, build_parser, format_soak_report, run_soak
from hybridserve.bench.configs import config_from_args
from tests.helpers.targets import CPU

SERVE_ARGS = [*CPU.cli_args(), "--max-num-seqs", "4", "--max-waiting-requests", "8", "--max-model-len", "4096",
              "--kv-cache-mib", "64", "--prefix-cache-mib", "64"]


def test_soak_flags_come_from_its_settings_dataclass() -> None:
    args = build_parser().parse_args(["--duration", "5"])
    assert config_from_args(SoakConfig, args) == SoakConfig(duration_s=5.0)
    assert (args.max_num_seqs, args.max_waiting_requests) == (4, 8)  # a small queue, for the bursts to overflow


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_soak_shortened() -> None:
    cfg = SoakConfig(duration_s=150.0, clients=5, overload_every_s=40.0, overload_burst=30, rss_window_s=30.0)
    result = run_soak(cfg, serve_args=SERVE_ARGS)
    report = format_soak_report(result)
    classes = result["by_class"]
    assert classes.get("5xx", 0) == 0 and classes.get("503_unexpected", 0) == 0, report
    assert classes.get("503_overload", 0) > 0, "the bursts must overflow the queue"
    assert classes.get("ok", 0) > 50 and classes.get("4xx_expected", 0) > 0, report
    assert not result["leaks"], report
    assert result["rss_growth"] < 0.05, report
    assert not result["failures"] and result["passed"], report

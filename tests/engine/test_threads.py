"""The thread default and `--threads` (no timing here: `python -m benchmarks.threads` measures)."""

from __future__ import annotations

import pytest
import torch

from hybridserve.cli import build_parser
from hybridserve.engine import threads


def test_default_uses_every_available_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "available_cores", lambda: 8)
    assert threads.default_num_threads() == 8
    monkeypatch.setattr(threads, "available_cores", lambda: 1)
    assert threads.default_num_threads() == 1


def test_configure_threads_sets_torch() -> None:
    before = torch.get_num_threads()
    try:
        assert threads.configure_threads(1) == 1 and torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="threads must be >= 1"):
            threads.configure_threads(0)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("command", [["generate"], ["serve"], ["bench", "engine"], ["bench", "serve"]])
def test_every_command_takes_threads(command: list[str]) -> None:
    assert build_parser().parse_args([*command, "--threads", "3"]).threads == 3

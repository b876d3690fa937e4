"""`python -m benchmarks.prefill_attention`: one small shape through both paths (no timing assertions)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.prefill_attention import main, measure
from hybridserve.layers import native


def test_measure_times_both_paths_and_they_agree() -> None:
    if not (native.native_kernels_enabled() and native.prefill_attention_max_tokens() > 0):
        pytest.skip("csrc/prefill_attention.c needs AVX-512")
    figures = measure(150, 70, repeats=1, gen=torch.Generator().manual_seed(1))
    assert figures["torch_ms"] > 0 and figures["c_ms"] > 0
    assert figures["max_abs_difference"] < 1e-4


def test_main_prints_json_or_says_why_not(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("benchmarks.prefill_attention.SHAPES", ((130, 10),))
    status = main(["--repeats", "1"])
    out = json.loads(capsys.readouterr().out)
    assert (status, "shapes" in out) in ((0, True), (1, False))

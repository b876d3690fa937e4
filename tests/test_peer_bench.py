"""`bench peer` pieces that need no llama.cpp, and (slow) a short end-to-end run when
llama-cpp-python is installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hybridserve.bench.llama_cpp_launch import NO_EXTRA_BUFTS, server_argv
from hybridserve.bench.peer_bench import (
    METRICS,
    PeerBenchConfig,
    WordPrompts,
    format_peer_report,
    hybridserve_supports_quantization,
    round_prompts,
    run_peer_bench,
    summarize,
)
from hybridserve.models.tokenizer import Tokenizer


def test_word_prompts_round_trip_through_text(builtin_tok: Tokenizer) -> None:
    source = WordPrompts(builtin_tok, seed=0)
    ids = source.fresh(500)
    assert builtin_tok.encode(source.text(ids)) == ids
    assert WordPrompts(builtin_tok, seed=0).fresh(20) == ids[:20]


def test_round_prompts_share_and_extend(builtin_tok: Tokenizer) -> None:
    cfg = PeerBenchConfig(prompt_tokens=80, shared_tokens=64, extend_tokens=8, decode_prompt_tokens=5, n_ctx=256)
    prompts = round_prompts(WordPrompts(builtin_tok, seed=1), cfg)
    assert len(prompts.cold) == len(prompts.warm) == 80 and len(prompts.decode) == 5
    assert prompts.warm[:64] == prompts.cold[:64] and prompts.warm[64:] != prompts.cold[64:]
    assert prompts.extend[:80] == prompts.warm and len(prompts.extend) == 88


def test_summary_and_report() -> None:
    rows = {"hybridserve": [{m: 1.0 for m in METRICS} | {"warm_ttft_cached_tokens": 4096.0}] * 3,
            "llama.cpp": [{m: 2.0 for m in METRICS}, {m: 3.0 for m in METRICS}, {m: 4.0 for m in METRICS}]}
    summary = summarize(rows)
    assert summary["ratio_llama_cpp_over_hybridserve"] == {m: 3.0 for m in METRICS}
    result = {"config": vars(PeerBenchConfig()) | {}, "gguf_type": "f32", **summary,
              "agreement": {"prompt_tokens": 32, "tokens": 32, "leading_agreed": 32, "same_positions": 32,
                            "max_logprob_diff": 1e-5}}
    report = format_peer_report(result)
    assert "32/32 leading tokens" in report and "3.00" in report and "4096 cached" in report
    assert "extra buffer types" not in report
    result["agreement"] |= {"llama_cpp_extra_bufts": False, "llama_cpp_crash_with_extra_bufts": "died"}
    assert "without its extra buffer types (AMX / repacked weights) after it crashed" in format_peer_report(result)
    result["batch_scaling"] = {"batch_size": 16,
                               "hybridserve": {"batch_1_step_ms": 2.5, "batch_step_ms": 5.0, "speedup": 8.0},
                               "llama.cpp": {"batch_1_step_ms": 5.0, "batch_step_ms": 20.0, "speedup": 4.0}}
    line = next(line for line in format_peer_report(result).splitlines() if line.startswith("decode step at batch"))
    assert "hybridserve 5.00 vs 2.50 ms" in line and "= 8.00x" in line and "llama.cpp 20.00 vs 5.00 ms" in line


def test_alternate_sizes_drops_warm_up_and_prefill() -> None:
    from hybridserve.bench.peer_bench import _alternate_sizes

    calls = []

    def step_times(batch: int) -> list[float]:
        calls.append(batch)
        first = 100.0 if len(calls) <= 2 else 1.0  # the warm-up pair is discarded
        return [50.0] + [first * batch] * 7  # the first eighth (prefill) is dropped
    assert _alternate_sizes(step_times, 4, iterations=2) == (1.0, 4.0)
    assert calls == [4, 1, 4, 1, 4, 1]


@pytest.mark.parametrize("size, iterations", [(1, 3), (-2, 3), (16, 0)])
def test_batch_scaling_settings_are_checked(size: int, iterations: int) -> None:
    with pytest.raises(ValueError, match="batch_size"):
        PeerBenchConfig(batch_size=size, batch_iterations=iterations)


@pytest.mark.skipif(hybridserve_supports_quantization(), reason="this hybridserve has --quantization")
def test_int8_needs_quantization_support() -> None:
    with pytest.raises(RuntimeError, match="needs --quantization support"):
        run_peer_bench(PeerBenchConfig(dtype="int8"), log=lambda _: None)


@pytest.mark.slow
def test_peer_bench_end_to_end(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (pip install -e '.[peer]')")
    pytest.importorskip("sse_starlette", reason="needs llama_cpp.server's extras (pip install -e '.[peer]')")
    cfg = PeerBenchConfig(prompt_tokens=288, shared_tokens=256, extend_tokens=16, decode_tokens=8, iterations=1,
                          warmup=0, agreement_tokens=8, n_ctx=512, work_dir=str(tmp_path), batch_size=3,
                          batch_iterations=1)
    result = run_peer_bench(cfg, log=lambda _: None)
    assert result["agreement"]["leading_agreed"] == 8, result["agreement"]
    assert set(result["median"]) == {"hybridserve", "llama.cpp"}
    for name in ("hybridserve", "llama.cpp"):
        assert all(result["median"][name][m] > 0 for m in METRICS)
    assert result["median"]["hybridserve"]["warm_ttft_cached_tokens"] == 256  # a snapshot boundary (interval 256)
    assert "llama.cpp / hybridserve" in format_peer_report(result)
    scaling = result["batch_scaling"]
    assert scaling["batch_size"] == 3
    for name in ("hybridserve", "llama.cpp"):
        assert scaling[name]["batch_step_ms"] > 0 and scaling[name]["batch_1_step_ms"] > 0
        assert scaling[name]["speedup"] == pytest.approx(3 * scaling[name]["batch_1_step_ms"]
                                                         / scaling[name]["batch_step_ms"])


def test_extra_bufts_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="llama_cpp_extra_bufts"):
        PeerBenchConfig(llama_cpp_extra_bufts="maybe")


def test_server_argv_without_extra_bufts() -> None:
    assert server_argv(True)[1:] == ["-m", "llama_cpp.server"]
    assert server_argv(False)[1:] == ["-m", "hybridserve.bench.llama_cpp_launch", NO_EXTRA_BUFTS]


def test_disable_extra_buffer_types_changes_the_default_params() -> None:
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (pip install -e '.[peer]')")
    code = ("from hybridserve.bench.llama_cpp_launch import disable_extra_buffer_types as off\n"
            "import llama_cpp.llama_cpp as lib\n"
            "before = lib.llama_model_default_params().use_extra_bufts\n"
            "off()\n"
            "print(before, lib.llama_model_default_params().use_extra_bufts)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["True", "False"]

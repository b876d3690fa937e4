"""The peer benchmark (`python -m benchmarks.peer`): its pieces without llama.cpp, and (slow) a short
end-to-end run when native llama.cpp has been built into bench-out/llama.cpp."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.peer.__main__ import main
from benchmarks.peer.peer_bench import (
    ENGINE_METRICS,
    ENGINES,
    SERVER_METRICS,
    LlamaServer,
    PeerBenchConfig,
    agreement,
    format_peer_report,
    llama_cpp_binaries,
    medians,
    parse_batched_bench,
    parse_llama_bench,
    run_peer_bench,
    server_prompts,
)
from hybridserve.bench.serve_client import PromptSource

BUILT = Path("bench-out/llama.cpp")


def test_server_prompts_share_and_extend() -> None:
    cfg = PeerBenchConfig(prompt_tokens=80, shared_tokens=64, extend_tokens=8, decode_prompt_tokens=5, n_ctx=256)
    prompts = server_prompts(PromptSource(1), cfg)
    assert len(prompts["cold"]) == len(prompts["warm"]) == 80 and len(prompts["decode_long"]) == 5
    assert prompts["warm"][:64] == prompts["cold"][:64] and prompts["warm"][64:] != prompts["cold"][64:]
    assert prompts["extend"][:80] == prompts["warm"] and len(prompts["extend"]) == 88
    assert prompts["decode_short"] != prompts["decode_long"]


@pytest.mark.parametrize("changes, match", [({"batch_size": 1}, "batch_size"), ({"batch_iterations": 0}, "batch_size"),
                                            ({"shared_tokens": 4160}, "shared_tokens"), ({"parts": ("gpu",)}, "parts"),
                                            ({"dtype": "fp8"}, "dtype")])
def test_settings_are_checked(changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PeerBenchConfig(**changes)


def test_parse_llama_bench_json() -> None:
    tests = [{"n_prompt": 4160, "n_gen": 0, "samples_ns": [3_000_000_000]},
             {"n_prompt": 0, "n_gen": 128, "samples_ns": [640_000_000]}]
    assert parse_llama_bench(tests) == {"prefill_ms": 3000.0, "decode_ms_per_token": 5.0}


def test_parse_batched_bench_jsonl() -> None:
    output = "\n".join(["llama_model_loader: ...", '{"pp": 32, "tg": 128, "pl": 1, "t_tg": 0.64, "speed_tg": 200.0}',
                        '{"pp": 32, "tg": 128, "pl": 16, "t_tg": 2.56, "speed_tg": 800.0}', "main: done"])
    assert parse_batched_bench(output) == pytest.approx({1: 5.0, 16: 20.0})


def test_agreement_counts_leading_tokens() -> None:
    result = agreement(([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4]), ([1, 2, 9, 4], [-0.1, -0.25, -1.0, -0.4]))
    assert (result["leading_agreed"], result["same_positions"]) == (2, 3)
    assert result["max_logprob_diff"] == pytest.approx(0.05)


def test_medians_and_report() -> None:
    rows = {"hybridserve": [{m: 1.0 for m in SERVER_METRICS} | {"warm_cached_tokens": 4096.0,
                                                                  "extend_cached_tokens": 4160.0}] * 3,
            "llama.cpp": [{m: v for m in SERVER_METRICS} | {"warm_cached_tokens": 0.0, "extend_cached_tokens": 4160.0}
                          for v in (2.0, 3.0, 4.0)]}
    servers = medians(rows, SERVER_METRICS)
    assert servers["ratio_llama_cpp_over_hybridserve"] == {m: 3.0 for m in SERVER_METRICS}
    engines = medians({"hybridserve": [{"prefill_ms": 2.0, "decode_ms_per_token": 4.0}],
                       "llama.cpp": [{"prefill_ms": 3.0, "decode_ms_per_token": 5.0}]}, ENGINE_METRICS)
    result = {"config": vars(PeerBenchConfig(repack=False)), "gguf_type": "f32", "servers": servers,
              "engines": engines, "agreement": agreement(([1] * 32, [0.0] * 32), ([1] * 32, [0.0] * 32)),
              "batch_scaling": {"batch_size": 16,
                                "hybridserve": {"batch_1_step_ms": 2.5, "batch_step_ms": 5.0, "speedup": 8.0},
                                "llama.cpp": {"batch_1_step_ms": 5.0, "batch_step_ms": 20.0, "speedup": 4.0}}}
    report = format_peer_report(result)
    assert "32/32 leading tokens" in report and "3.00" in report and "hybridserve 4096 / 4160" in report
    assert "1.50" in report and "1.25" in report  # the in-process ratios
    line = next(line for line in report.splitlines() if line.startswith("decode step at batch"))
    assert "hybridserve 5.00 vs 2.50 ms" in line and "= 8.00x" in line and "llama.cpp 20.00 vs 5.00 ms" in line
    assert "without weight repacking" in report


def test_missing_llama_cpp_names_the_build_script(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="build_llama_cpp.sh"):
        llama_cpp_binaries(PeerBenchConfig(llama_cpp_dir=str(tmp_path)))
    assert main(["--llama-cpp-dir", str(tmp_path)]) == 2


def test_llama_server_command(tmp_path: Path) -> None:
    server = LlamaServer(tmp_path / "llama-server", tmp_path / "m.gguf", PeerBenchConfig(threads=3, repack=False))
    assert server.argv[0] == str(tmp_path / "llama-server")
    assert server.argv[server.argv.index("-t") + 1] == "3" and "--no-repack" in server.argv
    assert server.argv[-2:] == ["--port", str(server.port)]


@pytest.mark.slow
def test_peer_bench_end_to_end(tmp_path: Path) -> None:
    pytest.importorskip("gguf", reason="the GGUF writer needs the `gguf` package")
    if not all((BUILT / "bin" / name).is_file() for name in ("llama-server", "llama-bench", "llama-batched-bench")):
        pytest.skip("needs native llama.cpp: benchmarks/peer/build_llama_cpp.sh")
    cfg = PeerBenchConfig(prompt_tokens=288, shared_tokens=256, extend_tokens=16, decode_tokens=8, iterations=1,
                          warmup=0, agreement_tokens=8, n_ctx=512, work_dir=str(tmp_path), batch_size=3,
                          batch_iterations=1, llama_cpp_dir=str(BUILT))
    result = run_peer_bench(cfg, log=lambda _: None)
    assert result["agreement"]["leading_agreed"] == 8, result["agreement"]
    for part, metrics in (("engines", ENGINE_METRICS), ("servers", SERVER_METRICS)):
        assert all(result[part]["median"][name][m] > 0 for name in ENGINES for m in metrics)
    assert result["servers"]["median"]["hybridserve"]["warm_cached_tokens"] == 256  # a snapshot boundary
    assert all(result["batch_scaling"][name]["speedup"] > 0 for name in ENGINES)
    assert "llama.cpp / hybridserve" in format_peer_report(result)
    json.dumps(result)

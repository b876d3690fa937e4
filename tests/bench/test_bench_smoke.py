"""Smoke tests of the benchmark code paths with tiny sizes (no timing assertions)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hybridserve.bench.common import cache_on_off, format_table, random_token_ids
from hybridserve.bench.engine_bench import EngineBenchConfig, format_engine_report, prefill_flops, run_engine_bench
from hybridserve.bench.trace_bench import TraceBenchConfig, format_trace_report, run_trace_bench
from hybridserve.bench.ttft_bench import TTFTBenchConfig, format_ttft_report, run_ttft_bench
from hybridserve.cli import build_parser, main
from hybridserve.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridserve.models.builtin import BUILTIN_MODEL_CONFIG
from tests.helpers.targets import CPU


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread: tiny ops gain nothing from two, and a busy machine stalls the second."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small_engine_config(interval: int = 32) -> EngineConfig:
    """The built-in model with small pools and a short context (fast to build)."""
    cache = CacheConfig(kv_cache_mib=16, prefix_cache_mib=64, snapshot_interval=interval)
    return EngineConfig(**CPU.engine_kwargs(), cache=cache, scheduler=SchedulerConfig(max_model_len=1024))


def write_trace(path: Path) -> Path:
    """Three requests; the second and third extend the first one's prefix."""
    records = [
        {"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 1, "input_length": 1500, "output_length": 50, "hash_ids": [0, 1, 2]},
        {"timestamp": 2, "input_length": 700, "output_length": 3, "hash_ids": [0, 3]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_prefill_flops_parts_add_up() -> None:
    parts = prefill_flops(BUILTIN_MODEL_CONFIG, 256, 64)
    assert parts["total"] == pytest.approx(parts["matmul"] + parts["attention"] + parts["gdn"] + parts["lm_head"])
    assert prefill_flops(BUILTIN_MODEL_CONFIG, 512, 64)["attention"] > 3.9 * parts["attention"]


def test_random_prompts_are_fixed_by_seed() -> None:
    assert random_token_ids(8, 1, 4096) == random_token_ids(8, 1, 4096) != random_token_ids(8, 2, 4096)
    assert "a" in format_table(["a", "b"], [[1, 2]])


def test_cache_on_off_engines_split_a_gpu_by_default() -> None:
    """Two benchmark engines in one process on one GPU each plan for half the default share; a
    size the caller gave, and CPU engines, are left alone."""
    on, off = cache_on_off(EngineConfig(device="cuda"))
    assert on.cache.memory_fraction == off.cache.memory_fraction == 0.45
    assert on.cache.prefix_cache_mib != 0 and off.cache.prefix_cache_mib == 0
    given = cache_on_off(EngineConfig(device="cuda", cache=CacheConfig(memory_fraction=0.3)))
    assert [c.cache.memory_fraction for c in given] == [0.3, 0.3]
    assert [c.cache.memory_fraction for c in cache_on_off(EngineConfig(device="cpu"))] == [None, None]


def test_engine_bench_smoke() -> None:
    cfg = EngineBenchConfig(prompt_tokens=40, decode_prompt_tokens=8, decode_tokens=3, batch_size=2, warmup=0,
                            iterations=1, matmul_size=64, matmul_repeats=1)
    result = run_engine_bench(small_engine_config(), cfg)
    assert result["decode_b1"]["greedy_tokens_matching"] == [3]  # same weights, same greedy tokens
    assert "(a) cold prefill" in format_engine_report(result)


def test_ttft_bench_smoke(tmp_path: Path) -> None:
    cfg = TTFTBenchConfig(cached_tokens=(32, 64), suffix_tokens=8, warmup=0, iterations=1, throughput_requests=2,
                          throughput_prompt_tokens=8, throughput_output_tokens=2)
    result = run_ttft_bench(small_engine_config(), cfg)
    for row in result["rows"]:
        assert row["warm_cached_tokens"] == [row["cached"]] and row["cold_cached_tokens"] == [0]
    assert result["throughput"]["cached_tokens"] == 0
    assert "warm/cold" in format_ttft_report(result)
    pytest.importorskip("matplotlib")
    from hybridserve.bench.ttft_bench import plot_ttft

    plot_ttft(result, str(tmp_path / "ttft.png"))
    assert (tmp_path / "ttft.png").stat().st_size > 0


def test_trace_bench_smoke(tmp_path: Path) -> None:
    cfg = TraceBenchConfig(trace_path=str(write_trace(tmp_path / "t.jsonl")), num_requests=3, block_tokens=32,
                           max_output_tokens=2, progress=False)
    result = run_trace_bench(small_engine_config(interval=32), cfg)
    assert result["outputs_match"]
    assert result["runs"]["off"]["cached_tokens"] == 0
    assert result["continuations"] == 1            # request 1 continues request 0's turn
    assert result["sim_matches_live"] and result["sim_hit_tokens"] == result["runs"]["on"]["cached_tokens"]
    # The continuation hits the end of request 0 (prompt + output - 1): the whole ceiling.
    assert result["runs"]["on"]["cached_tokens"] == round(result["ceiling_hit_share"] * result["prompt_tokens"]) > 0
    assert "SCALED replay" in format_trace_report(result)
    assert result["engine_tiers"] is False


def test_trace_bench_reports_the_host_tier(tmp_path: Path) -> None:
    cfg = TraceBenchConfig(trace_path=str(write_trace(tmp_path / "t.jsonl")), num_requests=3, block_tokens=32,
                           max_output_tokens=2, progress=False)
    config = small_engine_config(interval=32)
    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, host_cache_memory_bytes=64 << 20))
    result = run_trace_bench(config, cfg)
    assert result["engine_tiers"] is True and result["outputs_match"]


def test_cli_bench_subcommands(tmp_path: Path) -> None:
    parser = build_parser()
    for name in ("engine", "decode", "ttft", "trace", "chat", "structured", "tp", "serve", "all"):
        assert callable(parser.parse_args(["bench", name]).handler)
    out = tmp_path / "trace.json"
    trace = str(write_trace(tmp_path / "t.jsonl"))
    code = main(["bench", "trace", *CPU.cli_args(), "--trace", trace, "--num-requests", "2",
                 "--max-output-tokens", "1", "--no-progress", "--kv-cache-mib", "16", "--prefix-cache-mib", "64",
                 "--max-model-len", "1024", "--json", str(out)])
    assert code == 0 and json.loads(out.read_text())["num_requests"] == 2


def test_chat_bench_smoke() -> None:
    from hybridserve.bench.chat_bench import ChatBenchConfig, format_chat_report, run_chat_bench

    cfg = ChatBenchConfig(conversations=2, turns=3, system_tokens=40, message_tokens=12, reply_tokens=3,
                          long_after_tokens=60)
    result = run_chat_bench(small_engine_config(), cfg)
    summary = result["summary"]
    assert summary["turns_after_first"] == 4 and summary["turns_hitting_previous_end"] == 4
    assert summary["long_turns"] > 0 and "restored exactly" in format_chat_report(result)


def test_structured_bench_runs() -> None:
    from hybridserve.bench.structured_bench import StructuredBenchConfig, format_structured_report, run_structured_bench

    cfg = StructuredBenchConfig(batch_sizes=(1, 2), prompt_tokens=8, decode_tokens=6, warmup=0, iterations=1)
    result = run_structured_bench(small_engine_config(), cfg)
    assert [row["batch"] for row in result["rows"]] == [1, 2]
    assert all(row["pairs_measured"] > 0 and row["ratio"] > 0 for row in result["rows"])
    assert all(row["mask_ms"] > 0 for row in result["rows"])  # the engine's mask calls are timed (nan fails)
    assert result["compile_cache"]["misses"] == 1 and result["compile_cache"]["hits"] >= 3
    assert "JSON schema ms/step" in format_structured_report(result)
    assert build_parser().parse_args(["bench", "structured", "--batch-sizes", "1"]).batch_sizes == [1]


def test_decode_bench_smoke() -> None:
    from hybridserve.bench.decode_bench import DecodeBenchConfig, format_decode_report, run_decode_bench

    cfg = DecodeBenchConfig(variants=("float32", "int8"), prompt_tokens=8, decode_tokens=3, quality_prompts=1,
                            quality_prompt_tokens=16, greedy_tokens=3, warmup=0, iterations=1)
    result = run_decode_bench(small_engine_config(), cfg)
    speed = result["speed"]
    assert speed["int8"]["weight_mib"] < 0.5 * speed["float32"]["weight_mib"]
    assert all(s["decode_ms_per_token"] > 0 and s["weight_read_ms"] > 0 for s in speed.values())
    quality = result["quality"]["int8"]
    assert 0 < quality["mean_abs_logit_error"] <= quality["max_abs_logit_error"]
    assert 0 <= quality["top1_agreement"] <= 1
    assert "decode / read" in format_decode_report(result)


def test_tp_bench_smoke() -> None:
    """TP=1 and TP=2 side by side: the TP=2 row reads its communication shares from the executor."""
    from hybridserve.bench.tp_bench import TPBenchConfig, run_tp_bench

    result = run_tp_bench(small_engine_config(), TPBenchConfig(prompt_tokens=48, decode_tokens=3, iterations=1))
    rows = {row["tensor_parallel_size"]: row for row in result["rows"]}
    assert rows[1]["decode_ms_per_token"] > 0 and rows[2]["decode_ms_per_token"] > 0
    assert 0 <= rows[2]["prefill_comm_share"] <= 1 and 0 <= rows[2]["decode_comm_share"] <= 1


def test_bench_flags_come_from_the_settings_dataclasses() -> None:
    from hybridserve.bench import configs
    from hybridserve.bench.cli import ENGINE_BENCHES

    parser = build_parser()
    for name, config_cls in ENGINE_BENCHES.items():
        assert configs.config_from_args(config_cls, parser.parse_args(["bench", name])) == config_cls()
    args = parser.parse_args(["bench", "serve", "--no-mixed", "--bench-seed", "3", "--concurrency", "2", "4"])
    cfg = configs.config_from_args(configs.ServeBenchConfig, args)
    assert (cfg.mixed, cfg.seed, cfg.concurrency, cfg.token_logprobs) == (False, 3, (2, 4), True)
    assert not configs.config_from_args(configs.TraceBenchConfig,
                                         parser.parse_args(["bench", "trace", "--no-progress"])).progress

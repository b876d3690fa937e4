"""`hybridserve bench tp`: prefill and decode at TP=1 vs TP=2 on this machine, with the share of a
TP step spent in rank 0's all-reduces (shared memory or gloo; the row says which) and in the
controller's transport.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict
from typing import Any

from hybridserve.bench.common import EngineDriver, alternate, finish, format_table, greedy, median, random_token_ids
from hybridserve.bench.configs import TPBenchConfig
from hybridserve.config import EngineConfig
from hybridserve.distributed.executor import CommStats, TensorParallelExecutor
from hybridserve.engine.engine import LLMEngine

SETUPS = (("TP=1, 1 thread", 1, 1), ("TP=1, 2 threads", 1, 2), ("TP=2, 1 thread per rank", 2, 2))


def _comm(engine: LLMEngine) -> CommStats | None:
    executor = engine.executor
    return executor.comm_stats() if isinstance(executor, TensorParallelExecutor) else None


def _delta(after: CommStats | None, before: CommStats | None) -> tuple[float, float]:
    """(seconds in all-reduces, seconds in rank 0's forwards) between two readings."""
    if after is None or before is None:
        return 0.0, 0.0
    return after.comm_seconds - before.comm_seconds, after.forward_seconds - before.forward_seconds


def run_tp_bench(engine_config: EngineConfig, cfg: TPBenchConfig) -> dict[str, Any]:
    """Measure every setup: cold prefill TTFT, decode ms/token, and the communication shares."""
    engines = [LLMEngine(dataclasses.replace(engine_config, tensor_parallel_size=tp, num_threads=threads))
               for _, tp, threads in SETUPS]
    drivers = [EngineDriver(engine, f"tp{i}") for i, engine in enumerate(engines)]
    vocab = engines[0].model_config.vocab_size
    samples: list[dict[str, list[float]]] = [{} for _ in SETUPS]
    for driver in drivers:  # warm-up
        driver.run(random_token_ids(64, cfg.seed - 1, vocab), greedy(2))
    for iteration in range(cfg.iterations):
        for index in alternate(range(len(SETUPS)), iteration):
            phases = (("prefill", cfg.prompt_tokens, cfg.seed + iteration, 1),
                      ("decode", 32, cfg.seed + 100 + iteration, cfg.decode_tokens))
            for phase, prompt_tokens, seed, max_tokens in phases:
                before = _comm(engines[index])
                run = drivers[index].run(random_token_ids(prompt_tokens, seed, vocab), greedy(max_tokens))
                comm, forward = _delta(_comm(engines[index]), before)
                figures = {phase: run.ttft_s if phase == "prefill" else median(run.decode_step_s),
                           f"{phase}_comm": comm, f"{phase}_fwd": forward, f"{phase}_wall": run.total_s}
                for key, value in figures.items():
                    samples[index].setdefault(key, []).append(value)
    transports = [engine.executor.capacity.all_reduce if isinstance(engine.executor, TensorParallelExecutor) else None
                  for engine in engines]
    finish(*engines)
    rows = []
    for (name, tp, threads), out, transport in zip(SETUPS, samples, transports):
        name = name if transport is None else f"{name} ({transport} all-reduce)"
        row = {"setup": name, "tensor_parallel_size": tp, "threads": threads,
               "prefill_ttft_s": median(out["prefill"]), "decode_ms_per_token": 1000 * median(out["decode"])}
        if tp > 1:
            row["prefill_comm_share"] = sum(out["prefill_comm"]) / sum(out["prefill"])
            row["decode_comm_share"] = sum(out["decode_comm"]) / sum(out["decode_wall"])
            row["decode_transport_share"] = 1 - sum(out["decode_fwd"]) / sum(out["decode_wall"])
        rows.append(row)
    return {"config": asdict(cfg), "rows": rows}


def format_tp_report(result: dict[str, Any]) -> str:
    """Markdown table of `run_tp_bench`'s figures."""
    base = result["rows"][1]
    body = []
    for row in result["rows"]:
        def share(key: str, row: dict[str, Any] = row) -> str:
            return f"{100 * row[key]:.1f}%" if key in row else "-"

        body.append([row["setup"], f"{1000 * row['prefill_ttft_s']:.0f} ms",
                     f"{base['prefill_ttft_s'] / row['prefill_ttft_s']:.2f}x", f"{row['decode_ms_per_token']:.1f} ms",
                     f"{base['decode_ms_per_token'] / row['decode_ms_per_token']:.2f}x",
                     share("prefill_comm_share"), share("decode_comm_share"), share("decode_transport_share")])
    cfg = result["config"]
    return (f"prefill: {cfg['prompt_tokens']}-token cold prompt; decode: ms/token of one sequence "
            f"({cfg['decode_tokens']} tokens); p50 of {cfg['iterations']}\n"
            + format_table(["setup", "prefill TTFT", "vs TP=1/2t", "decode", "vs TP=1/2t", "all-reduce share "
                            "(prefill)", "all-reduce share (decode)", "transport share (decode)"], body))

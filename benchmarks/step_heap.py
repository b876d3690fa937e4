"""`python -m benchmarks.step_heap`: the CPU engine's heap by step kind (engine/memory.py), old and new
side by side in one process.

Old: every step's large allocations come from the kept heap (a prefill step's threshold set to the
retained one). New: a prefill step maps them on its own, a decode step keeps reusing the heap.
Pairs alternate their order (old first, then new first); per pair: batch-1 decode ms/token after a
short prompt, and the TTFT of a long prompt. Reports the medians and the median of the per-pair
ratios new/old.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from typing import Any

from hybridserve.bench.common import EngineDriver, greedy, random_token_ids
from hybridserve.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridserve.engine import memory
from hybridserve.engine.engine import LLMEngine

MODES = ("old", "new")


def use_mode(mode: str) -> None:
    """Make the coming steps behave as `mode` ("old": prefill steps keep their allocations in the heap)."""
    memory._PREFILL_MMAP_THRESHOLD = memory._RETAIN_BYTES if mode == "old" else memory._DEFAULT_THRESHOLD_BYTES
    memory.retain_freed_activation_memory()  # the serving thresholds; the next prefill step sets its own


def measure_pair(driver: EngineDriver, order: Sequence[str], seed: int, args: argparse.Namespace
                 ) -> dict[str, dict[str, float]]:
    """One round of each mode in `order`: decode ms/token and long-prompt TTFT (ms)."""
    vocab = driver.engine.model_config.vocab_size
    out: dict[str, dict[str, float]] = {}
    for mode in order:
        use_mode(mode)
        run = driver.run(random_token_ids(args.prompt_tokens, seed, vocab), greedy(args.decode_tokens))
        ttft = driver.run(random_token_ids(args.long_prompt_tokens, seed + 1, vocab), greedy(1)).ttft_s
        out[mode] = {"decode_ms_per_token": 1000 * statistics.median(run.decode_step_s),
                     f"ttft_{args.long_prompt_tokens}_ms": 1000 * ttft}
    return out


def summarize(pairs: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Medians per mode and the median of the per-pair ratios new/old."""
    names = list(pairs[0]["old"])
    summary: dict[str, Any] = {mode: {name: statistics.median(p[mode][name] for p in pairs) for name in names}
                               for mode in MODES}
    summary["new/old (median of per-pair ratios)"] = {
        name: statistics.median(p["new"][name] / p["old"][name] for p in pairs) for name in names}
    return summary


def main(argv: list[str] | None = None) -> int:
    """Run the pairs on the built-in model (float32) and print the figures as JSON."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_heap", description=__doc__)
    parser.add_argument("--pairs", type=int, default=10, help="measured pairs (one discarded before)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--long-prompt-tokens", type=int, default=4096)
    args = parser.parse_args(argv)
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32",
                                    cache=CacheConfig(kv_cache_mib=256, prefix_cache_mib=0),
                                    scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=8192)))
    driver = EngineDriver(engine, "step-heap")
    pairs = []
    for index in range(args.pairs + 1):
        pair = measure_pair(driver, MODES if index % 2 == 0 else MODES[::-1], 1000 * index, args)
        if index:
            pairs.append(pair)
    result = summarize(pairs)
    result["pairs"] = pairs
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

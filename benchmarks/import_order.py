"""Decode speed by import order: `import torch` before `import hybridserve` against the reverse.

Each round runs both orders in fresh subprocesses, alternating which goes first; each run times
batch-1 greedy decode of the built-in model (median of three 128-token requests after a warm-up).
The report gives the median ms/token per order and their ratio (the goal: within 5 %).

    python -m benchmarks.import_order [--rounds 5] [--tree DIR]

`--tree` runs another checkout's package (e.g. a worktree of an older commit) with this venv.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ORDERS = ("torch-first", "hybridserve-first")

CHILD = r"""
import json, sys, time
if sys.argv[1] == "torch-first":
    import torch
    import hybridserve
else:
    import hybridserve
    import torch
from hybridserve import LLM, SamplingParams

engine = LLM(kv_cache_mib=64, prefix_cache_mib=0).llm_engine


def decode_ms(tokens):
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(f"r{time.perf_counter_ns()}", list(range(10, 42)), params)
    stamps = []
    while engine.has_unfinished_requests():
        engine.step()
        stamps.append(time.perf_counter())
    return 1000 * (stamps[-1] - stamps[1]) / (len(stamps) - 2)


decode_ms(16)
print(json.dumps({"ms": sorted(decode_ms(128) for _ in range(3))[1], "threads": torch.get_num_threads()}))
"""


def run_once(order: str, tree: Path) -> dict[str, float]:
    """One subprocess decode measurement in `order`, importing the package from `tree`."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = str(tree)
    out = subprocess.run([sys.executable, "-c", CHILD, order], cwd=tree, env=env, capture_output=True, text=True,
                         check=True).stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> None:
    """Alternate both orders for `--rounds` rounds and print the medians and their ratio."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {order: [] for order in ORDERS}
    for round_index in range(args.rounds):
        for order in ORDERS if round_index % 2 == 0 else reversed(ORDERS):
            result = run_once(order, args.tree)
            times[order].append(result["ms"])
            print(f"round {round_index + 1} {order}: {result['ms']:.2f} ms/token ({result['threads']:.0f} threads)",
                  flush=True)
    first, second = (statistics.median(times[order]) for order in ORDERS)
    print(f"median ms/token: torch first {first:.2f}, hybridserve first {second:.2f}; ratio {first / second:.3f}")


if __name__ == "__main__":
    main()

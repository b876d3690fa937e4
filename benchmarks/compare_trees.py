"""Two checkouts of hybridserve side by side: decode ms/token, cold and warm TTFT, alternated.

Each round runs one subprocess per tree (their order flips every round), importing the package
from that tree with this venv: batch-1 greedy decode (median of three 128-token requests), the
cold TTFT of a 4160-token prompt, and the warm TTFT of 4096 cached + 64 new tokens (median of 5).

    python -m benchmarks.compare_trees BEFORE_DIR AFTER_DIR [--rounds 3]

A worktree of an older commit makes BEFORE_DIR: `git worktree add /tmp/before <commit>`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

MEASURES = ("decode_ms", "cold_4160_ms", "warm_4096_64_ms")

CHILD = r"""
import json, random, statistics, time
from hybridserve.config import CacheConfig, EngineConfig
from hybridserve.engine.engine import LLMEngine
from hybridserve.sampling_params import SamplingParams

engine = LLMEngine(EngineConfig(device="cpu", dtype="float32",
                                cache=CacheConfig(kv_cache_mib=512, prefix_cache_mib=512)))
rng, count = random.Random(0), [0]


def tokens(n):
    return [rng.randrange(10, 4000) for _ in range(n)]


def run(prompt, max_tokens):
    count[0] += 1
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(f"r{count[0]}", prompt, params)
    start, stamps = time.perf_counter(), []
    while engine.has_unfinished_requests():
        engine.step()
        stamps.append(time.perf_counter())
    return start, stamps


run(tokens(64), 16)
decode = []
for _ in range(3):
    _, stamps = run(tokens(32), 128)
    decode.append(1000 * (stamps[-1] - stamps[1]) / (len(stamps) - 2))
prefix = tokens(4096)
start, stamps = run(prefix + tokens(64), 1)
cold = 1000 * (stamps[0] - start)
warm = []
for _ in range(5):
    start, stamps = run(prefix + tokens(64), 1)
    warm.append(1000 * (stamps[0] - start))
print(json.dumps({"decode_ms": statistics.median(decode), "cold_4160_ms": cold,
                  "warm_4096_64_ms": statistics.median(warm)}))
"""


def measure(tree: Path) -> dict[str, float]:
    """One subprocess run of the measures, importing hybridserve from `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=tree, env=env, capture_output=True, text=True,
                         check=True).stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> None:
    """Alternate the two trees for `--rounds` rounds; print each run and the medians."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for round_index in range(args.rounds):
        names = list(trees) if round_index % 2 == 0 else list(reversed(trees))
        for name in names:
            result = measure(trees[name])
            runs[name].append(result)
            print(f"round {round_index + 1} {name}: {json.dumps(result)}", flush=True)
    for measure_name in MEASURES:
        medians = [statistics.median(r[measure_name] for r in runs[name]) for name in trees]
        print(f"{measure_name}: before {medians[0]:.2f}, after {medians[1]:.2f}, "
              f"after/before {medians[1] / medians[0]:.3f}")


if __name__ == "__main__":
    main()

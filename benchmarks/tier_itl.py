"""`python -m benchmarks.tier_itl`: decode inter-token latency while the cache tiers move data (issue 35).

Built-in model, one engine driven step by step. A greedy decode stream (`--decode-tokens` tokens
after a short prompt) runs while a churn of short-answer requests runs beside it, one at a time:
each is one of `--prefixes` shared prefixes (`--prefix-tokens` long) plus a few fresh tokens, in
rotation, so more prefixes are in use than the small device pools hold. Setups, same traffic:

- off: small device pools, no lower tier (a prefix pushed off the device is recomputed);
- host: the same small pools plus a host tier (a prefix comes back by promotion, and making room
  demotes another: the tiers move data on every churn request);
- roomy: device pools large enough for every prefix (no movement, no recompute: the floor).

The inter-token latency (ITL) is the wall time between two steps that gave the decode stream a
token. Setups alternate per round; the report gives each setup's median over rounds of its p50
and p99, and the goal ratio host p99 / off p99 (≤ 1.2), with host / roomy beside it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from hybridserve.config import TIER_WRITE_POLICIES

SETUPS = ("off", "host", "roomy")
GOAL = 1.2  # host ITL p99 over off ITL p99


def _tokens(length: int, seed: int) -> list[int]:
    return torch.randint(0, 4000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


class ItlBench:
    """One engine per setup and the measured decode stream."""

    def __init__(self, args: argparse.Namespace) -> None:
        from hybridserve import LLM, SamplingParams

        self.args = args
        small: dict[str, Any] = {"kv_cache_mib": args.kv_cache_mib, "prefix_cache_mib": args.prefix_cache_mib}
        roomy: dict[str, Any] = {"kv_cache_mib": 16 * args.kv_cache_mib, "prefix_cache_mib": 32 * args.prefix_cache_mib}
        common: dict[str, Any] = {"device": "cpu", "dtype": "float32", "cache_policy": "interval",
                  "snapshot_interval": args.prefix_tokens, "max_num_batched_tokens": args.max_num_batched_tokens}
        self.engines = {"off": LLM(**common, **small), "host": LLM(**common, **small, host_cache_memory="512MiB",
                                                                      tier_write_policy=args.tier_write_policy),
                        "roomy": LLM(**common, **roomy)}
        self.decode_params = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
        self.churn_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self.prefixes = [_tokens(args.prefix_tokens, 100 + index) for index in range(args.prefixes)]
        self._ids = itertools.count()

    def warm(self) -> None:
        """Serve every prefix once on every engine (what the churn will reuse), and let the host
        tier's demotions land."""
        for llm in self.engines.values():
            llm.generate([p + _tokens(8, 7) for p in self.prefixes], self.churn_params, use_tqdm=False)
            _settle(llm)

    def measure(self, setup: str, seed: int) -> dict[str, Any]:
        """One decode stream beside the churn; its inter-token gaps and the churn's cached share."""
        engine = self.engines[setup].llm_engine
        decode_id = f"decode-{next(self._ids)}"
        engine.add_request(decode_id, _tokens(64, seed), self.decode_params)
        churn: str | None = None
        rotation = itertools.count(seed)
        stamps: list[float] = []
        cached = prompted = 0
        while True:
            if churn is None:
                turn = next(rotation)
                churn = f"churn-{next(self._ids)}"
                prompt = self.prefixes[turn % len(self.prefixes)] + _tokens(16, seed * 1000 + turn)
                engine.add_request(churn, prompt, self.churn_params)
            outputs = engine.step()
            now = time.perf_counter()
            done = False
            for out in outputs:
                if out.request_id == decode_id:
                    stamps.append(now)
                    done = out.finished
                elif out.request_id == churn and out.finished:
                    cached += out.num_cached_tokens
                    prompted += len(out.prompt_token_ids or [])
                    churn = None
            if done:
                break
        if churn is not None:
            engine.abort_request(churn)
        gaps = [later - earlier for earlier, later in zip(stamps, stamps[1:])]
        return {"p50": _percentile(gaps, 0.5), "p99": _percentile(gaps, 0.99), "gaps": len(gaps),
                "cached_share": cached / max(prompted, 1)}

    def close(self) -> None:
        """Shut every engine down."""
        for llm in self.engines.values():
            llm.llm_engine.shutdown()


def _settle(llm: Any) -> None:
    mover = llm.llm_engine.tier_mover
    while mover is not None and mover.busy:
        llm.llm_engine.step()
        mover.wait(0.05)


def run(args: argparse.Namespace, log: Any = print) -> dict[str, Any]:
    """Alternate the setups for `--rounds` rounds after a warm-up round; medians per setup."""
    bench = ItlBench(args)
    rows: dict[str, list[dict[str, Any]]] = {setup: [] for setup in SETUPS}
    try:
        bench.warm()
        for round_index in range(args.rounds + 1):
            order = SETUPS[round_index % len(SETUPS):] + SETUPS[:round_index % len(SETUPS)]
            measured = {setup: bench.measure(setup, 10 + round_index) for setup in order}
            log(f"round {round_index}{' (warm-up)' if round_index == 0 else ''}: " + ", ".join(
                f"{s} p50 {1e3 * measured[s]['p50']:.1f} p99 {1e3 * measured[s]['p99']:.1f} ms "
                f"(cached {measured[s]['cached_share']:.0%})" for s in SETUPS))
            if round_index:
                for setup in SETUPS:
                    rows[setup].append(measured[setup])
    finally:
        bench.close()
    summary = {setup: {key: statistics.median(row[key] for row in rows[setup])
                       for key in ("p50", "p99", "cached_share")} for setup in SETUPS}
    return {"setups": summary, "rounds": args.rounds,
            "host_over_off_p99": summary["host"]["p99"] / summary["off"]["p99"],
            "host_over_roomy_p99": summary["host"]["p99"] / summary["roomy"]["p99"]}


def main(argv: list[str] | None = None) -> int:
    """Print the per-setup medians and the goal ratio (and JSON with --json)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tier_itl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=300)
    parser.add_argument("--prefixes", type=int, default=12, help="shared prefixes in rotation")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--kv-cache-mib", type=float, default=8, help="small device KV pool (roomy: 16x)")
    parser.add_argument("--prefix-cache-mib", type=float, default=1, help="small device snapshot pool (roomy: 32x)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="prefill chunk per step")
    parser.add_argument("--tier-write-policy", default="write-through", choices=TIER_WRITE_POLICIES,
                        help="the host setup's write policy (the server's default: write-through)")
    parser.add_argument("--json", metavar="PATH", default=None)
    args = parser.parse_args(argv)
    result = run(args)
    for setup, figures in result["setups"].items():
        print(f"{setup:6} ITL p50 {1e3 * figures['p50']:6.1f} ms  p99 {1e3 * figures['p99']:6.1f} ms  "
              f"churn cached share {figures['cached_share']:.0%}")
    print(f"host / off ITL p99: {result['host_over_off_p99']:.2f} (goal <= {GOAL}); "
          f"host / roomy: {result['host_over_roomy_p99']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m benchmarks.router_overhead`: the joint-aware router's cost per request (issue 38).

Builds `--replicas` replica summaries of `--boundaries` joint boundaries each, as engines with the
default keyed block hash and `--block-size` publish them: conversations whose paths carry a boundary
every `--boundary-every` tokens and a tail boundary at their end. Then times, per request, what the
router does on the request path: `JointIndex.depths` (hash the prompt once, look each boundary on its
path up) and `choose_replica`. Half the prompts continue a cached conversation (a later turn, so a hit
on one replica), half are fresh; prompt lengths are drawn between `--min-tokens` and `--max-tokens`.
Reports the median and p99 per request, the summary size (JSON) and the time to apply one summary.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from hybridserve.cache.block_pool import KeyedHash, block_hashes_for, hash_tail
from hybridserve.routing.index import JointIndex
from hybridserve.routing.policy import RouterConfig, choose_replica
from hybridserve.routing.summary import JointBoundary, encode_summary, hash_identity


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(300, 150_000) for _ in range(count)]


def _path_boundaries(path: list[int], block_size: int, every: int, algorithm: KeyedHash) -> list[JointBoundary]:
    """Boundaries along one conversation path: every `every` tokens, and a tail at its end."""
    hashes = block_hashes_for(path, block_size, algorithm=algorithm)
    out = [JointBoundary(hashes[depth // block_size - 1], None, depth, "device")
           for depth in range(every, len(path) + 1, every)]
    full, partial = divmod(len(path), block_size)
    if partial:
        parent = hashes[full - 1] if full else None
        tail = hash_tail(parent, path[full * block_size:], (), algorithm)
        out.append(JointBoundary(tail, parent, len(path), "host"))
    return out


def build(args: argparse.Namespace) -> tuple[JointIndex, list[dict[str, Any]], list[list[int]]]:
    """The router's index over every replica's summary, the summaries, and the timed prompts."""
    rng = random.Random(args.seed)
    algorithm = KeyedHash(rng.getrandbits(64))
    index = JointIndex(args.block_size, algorithm)
    summaries, paths = [], []
    for replica in range(args.replicas):
        boundaries: list[JointBoundary] = []
        while len(boundaries) < args.boundaries:
            path = _tokens(rng, rng.randint(args.min_tokens, args.max_tokens))
            boundaries += _path_boundaries(path, args.block_size, args.boundary_every, algorithm)
            paths.append(path)
        summary = encode_summary(boundaries[:args.boundaries], args.block_size, 1, hash_identity(algorithm))
        summaries.append(summary)
        index.update(f"replica-{replica}", summary)
    prompts = []
    for _ in range(args.requests):
        if rng.random() < 0.5:
            prompts.append(rng.choice(paths) + _tokens(rng, rng.randint(16, 512)))
        else:
            prompts.append(_tokens(rng, rng.randint(args.min_tokens, args.max_tokens)))
    return index, summaries, prompts


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Time the router's per-request work and a summary's application."""
    index, summaries, prompts = build(args)
    config = RouterConfig()
    rng = random.Random(args.seed + 1)
    loads = {name: rng.uniform(0, 20_000) for name in index.replicas}
    samples, hits = [], 0
    for turn, prompt in enumerate(prompts):
        start = time.perf_counter()
        depths = index.depths(prompt, None)
        decision = choose_replica(depths, loads, len(prompt), config, turn)
        samples.append(time.perf_counter() - start)
        hits += depths[decision.replica] > 0
    applies = []
    for epoch, summary in enumerate(summaries * 2, start=2):
        start = time.perf_counter()
        index.update("replica-0", {**summary, "epoch": epoch})
        applies.append(time.perf_counter() - start)
    samples.sort()
    return {"replicas": args.replicas, "boundaries_per_replica": args.boundaries, "block_size": args.block_size,
            "prompt_tokens": [args.min_tokens, args.max_tokens], "requests": len(samples),
            "routed_to_a_hit": hits / len(samples),
            "median_ms": 1e3 * statistics.median(samples), "p99_ms": 1e3 * samples[int(0.99 * (len(samples) - 1))],
            "summary_json_kib": len(json.dumps(summaries[0])) / 1024,
            "summary_apply_ms": 1e3 * statistics.median(applies)}


def main(argv: list[str] | None = None) -> int:
    """Parse flags, measure, print one line per figure (and JSON with --json)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.router_overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--boundaries", type=int, default=4000, help="joint boundaries per replica summary")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (the engine's default)")
    parser.add_argument("--boundary-every", type=int, default=1024, help="tokens between boundaries on a path")
    parser.add_argument("--min-tokens", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", default=None)
    args = parser.parse_args(argv)
    report = measure(args)
    for key, value in report.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

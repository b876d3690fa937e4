"""`hybridserve sim --replicas N`: run each router over the trace and print one table (torch-free
at import; the replay itself loads when the command runs)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridserve.sim.links import Link
    from hybridserve.sim.routing import RoutingResult
    from hybridserve.sim.shapes import ModelShape
    from hybridserve.sim.trace import TraceTokens

ROUTERS = ("round-robin", "least-load", "session", "joint")
GIB = 1 << 30


def _one(values: list[Any], flag: str) -> Any:
    if len(values) != 1:
        raise ValueError(f"with --replicas, give one {flag} value (the total over all replicas, split evenly)")
    return values[0]


def known_names(text: str, known: Sequence[str], what: str) -> list[str]:
    """The comma-separated names in `text`, each one of `known` (ValueError naming `what` otherwise)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in known]
    if not names or unknown:
        raise ValueError(f"unknown {what} {', '.join(unknown) or repr(text)}; choose from {', '.join(known)}")
    return names


def run_routing(args: argparse.Namespace, shape: ModelShape, tokens: TraceTokens, policy: str,
                snapshot_budgets: list[float], kv_budgets: list[float], tier_budgets: list[tuple[float, float]],
                links: list[Link]) -> int:
    """Replay one replica holding every budget, then each router over `args.replicas` replicas."""
    from hybridserve.sim.routing import SINGLE, RoutingSimConfig, simulate_routing
    from hybridserve.sim.simulator import SimConfig

    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.summary_period_s < 0 or args.utilization <= 0 or args.load_half_life_s < 0:
        raise ValueError("--summary-period-s and --load-half-life-s must be >= 0, --utilization > 0")
    routers = known_names(args.router, ROUTERS, "router")
    host, disk = _one(tier_budgets, "--host-budgets-gib/--disk-budgets-gib")
    cache = SimConfig(policy, int(_one(kv_budgets, "--kv-budgets-gib") * GIB),
                      int(_one(snapshot_budgets, "--snapshot-budgets-gib") * GIB), args.block_size,
                      args.snapshot_interval, int(host * GIB), int(disk * GIB), links[0], links[1],
                      args.tier_write_policy == "write-through")
    results = []
    for router, replicas in [(SINGLE, 1)] + [(name, args.replicas) for name in routers]:
        config = RoutingSimConfig(cache, replicas, router, args.summary_period_s, args.utilization,
                                  args.load_half_life_s)
        result = simulate_routing(tokens, shape, config, progress=not args.no_progress)
        print(f"[sim] {router} x{replicas}: {result.hit_rate:.2%} hit, balance {result.balance:.2f} "
              f"({result.seconds:.1f} s)", file=sys.stderr, flush=True)
        results.append(result)
    report = routing_report(args, shape, results, args.prefill_tflops * 1e12)
    print(format_routing_report(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    return 0


def routing_report(args: argparse.Namespace, shape: ModelShape, results: list[RoutingResult],
                   prefill_flops: float) -> dict[str, Any]:
    """Every figure of a routed run, JSON-ready; the first result is the one-replica reference."""
    single = results[0].hit_rate
    rows = [{
        "router": r.config.router, "replicas": r.config.replicas, "requests": r.requests, "skipped": r.skipped,
        "token_hit_rate": r.hit_rate, "of_single": r.hit_rate / single if single else None,
        "prefill_flops_saved_share": r.saved_flops / max(r.prefill_flops, 1.0),
        "prefill_seconds_saved": r.saved_flops / prefill_flops, "work_max_over_mean": r.balance,
        "work_per_replica": list(r.work), "mean_wait_s": r.mean_wait, "decisions": dict(r.reasons),
        "predicted_exact": r.predicted_exact if r.config.router == "joint" else None,
        "route_us_per_request": 1e6 * r.route_seconds / max(r.requests, 1), "seconds": r.seconds,
    } for r in results]
    config = results[0].config
    trace = f"workload:{args.workload}:seed={args.workload_seed}" if args.workload else args.trace
    return {"trace": trace, "model_shape": shape.name, "policy": config.cache.policy,
            "kv_budget_gib": config.cache.kv_bytes / GIB, "snapshot_budget_gib": config.cache.snapshot_bytes / GIB,
            "host_budget_gib": config.cache.host_bytes / GIB, "disk_budget_gib": config.cache.disk_bytes / GIB,
            "block_size": config.cache.block_size, "block_tokens": args.block_tokens,
            "summary_period_s": config.summary_period, "utilization": config.utilization,
            "load_half_life_s": config.load_half_life, "rows": rows}


COLUMNS = (
    ("router", "single: one replica with every budget (the reference); the others route across the replicas"),
    ("replicas", "replicas, each with 1/N of every budget"),
    ("token hit", "prompt tokens restored from a cache / all prompt tokens"),
    ("of single", "token hit / the single replica's"),
    ("prefill s saved", "prefill seconds the hits save at --prefill-tflops"),
    ("max/mean work", "the busiest replica's work (uncached prompt + output tokens) over the mean"),
    ("wait s", "mean seconds a request queued behind others on its replica"),
    ("hit/fallback/none", "joint router decisions: joint hit, load fallback, no useful hit"),
    ("exact", "joint: share of requests whose hit equals the depth the router saw (staleness)"),
    ("us/route", "time choosing a replica per request (joint: index lookup + policy)"),
)


def format_routing_report(report: dict[str, Any]) -> str:
    """The table `hybridserve sim --replicas N` prints."""
    lines = [f"{report['trace']}: shape {report['model_shape']}, policy {report['policy']}, totals KV "
             f"{report['kv_budget_gib']:g} GiB, snapshots {report['snapshot_budget_gib']:g} GiB, host "
             f"{report['host_budget_gib']:g} GiB, disk {report['disk_budget_gib']:g} GiB; "
             f"block {report['block_size']}; "
             f"summaries every {report['summary_period_s']:g} s; cold utilization {report['utilization']:g}; "
             f"load = queued work + recent work (half-life {report['load_half_life_s']:g} s)",
             "columns:"]
    lines += [f"  {name:>17}: {meaning}" for name, meaning in COLUMNS]
    widths = [11, 8, 9, 9, 15, 13, 8, 17, 6, 8]
    lines.append("  ".join(f"{name:>{w}}" for (name, _), w in zip(COLUMNS, widths)))
    for row in report["rows"]:
        decisions = row["decisions"]
        cells = [row["router"], str(row["replicas"]), f"{row['token_hit_rate']:.2%}",
                 "-" if row["of_single"] is None else f"{row['of_single']:.3f}", f"{row['prefill_seconds_saved']:.1f}",
                 f"{row['work_max_over_mean']:.3f}", f"{row['mean_wait_s']:.2f}",
                 "/".join(str(decisions.get(k, 0)) for k in ("joint_hit", "load_fallback", "no_hit"))
                 if decisions else "-",
                 "-" if row["predicted_exact"] is None else f"{row['predicted_exact']:.2f}",
                 f"{row['route_us_per_request']:.0f}"]
        lines.append("  ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    return "\n".join(lines)

"""`hybridserve sim`: replay a trace through the cache code under several policies and budgets.

The flags need no torch; the simulator and the model shapes load when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from hybridserve.config import POLICY_NAMES, TIER_WRITE_POLICIES
from hybridserve.routing.policy import LOAD_HALF_LIFE_S
from hybridserve.sim.links import DISK_LINK, HOST_LINK, PREFILL_FLOPS
from hybridserve.sim.routing_report import ROUTERS, known_names, run_routing
from hybridserve.sim.trace import TRACE_BLOCK_TOKENS, default_trace_path

if TYPE_CHECKING:
    from hybridserve.sim.shapes import ModelShape
    from hybridserve.sim.simulator import SimResult

GIB = 1 << 30


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `hybridserve sim`."""
    parser.add_argument("--trace", default=str(default_trace_path()), help="Mooncake-format JSONL trace")
    parser.add_argument("--workload", default=None, metavar="NAME",
                        help="replay a generated workload instead of --trace: agent, chat, chat-regenerate, "
                             "conversation-synthetic or mixed (hybridserve/sim/workloads.py; --num-requests sets its "
                             "size, default 2000)")
    parser.add_argument("--workload-seed", type=int, default=0, help="seed of the generated --workload")
    parser.add_argument("--num-requests", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--model-shape", default="qwen3.5-4b",
                        help="a shape named in hybridserve/sim/shapes.py (an unknown name lists them), or a path "
                             "to a config.json")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES), help="comma-separated cache policies")
    parser.add_argument("--snapshot-budgets-gib", default="1,2,4,8,16,32,64",
                        help="comma-separated GDN snapshot budgets (GiB)")
    parser.add_argument("--kv-budgets-gib", default="1024", help="comma-separated KV cache budgets (GiB)")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per KV block")
    parser.add_argument("--snapshot-interval", type=int, default=256,
                        help="interval of the interval policy (and hybridserve's opportunistic marks)")
    parser.add_argument("--block-tokens", type=int, default=TRACE_BLOCK_TOKENS,
                        help="tokens per trace hash block (512 = unscaled)")
    parser.add_argument("--json", metavar="PATH", default=None, help="write every figure as JSON here")
    parser.add_argument("--plot", metavar="PATH", default=None, help="write hit rate vs budget (PNG) here")
    parser.add_argument("--host-budgets-gib", default="0",
                        help="comma-separated host-memory tier budgets (GiB; 0 = no host tier): joint entries of "
                             "GDN state and prefix KV demoted from the device (docs/prefix-cache.md, Tiers)")
    parser.add_argument("--disk-budgets-gib", default="0",
                        help="comma-separated disk tier budgets (GiB; 0 = no disk tier), below the host tier")
    parser.add_argument("--host-bandwidth-gbs", type=float, default=HOST_LINK.bandwidth / 1e9,
                        help="host <-> device copy bandwidth, GB/s (default: PCIe 5 x16 as achieved)")
    parser.add_argument("--host-latency-us", type=float, default=HOST_LINK.latency * 1e6,
                        help="host <-> device latency per transfer, microseconds")
    parser.add_argument("--disk-bandwidth-gbs", type=float, default=DISK_LINK.bandwidth / 1e9,
                        help="disk -> device bandwidth, GB/s (default: one NVMe drive)")
    parser.add_argument("--disk-latency-us", type=float, default=DISK_LINK.latency * 1e6,
                        help="disk latency per transfer, microseconds")
    parser.add_argument("--prefill-tflops", type=float, default=PREFILL_FLOPS / 1e12,
                        help="prefill throughput the saved time is estimated with, TFLOP/s")
    parser.add_argument("--tier-write-policy", default="write-through", choices=TIER_WRITE_POLICIES,
                        help="as the server's: write-through copies each snapshot one tier down when published, "
                             "write-back when it is evicted")
    parser.add_argument("--oracle", action="store_true",
                        help="add a clairvoyant reference row per budget: the same cache admitting only states a "
                             "later request restores, evicting the one restored last (hybridserve/sim/oracle.py)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="route the trace across N replicas, each with 1/N of every budget (give one policy, "
                             "the first of --policies, and one value per budget flag: the totals), and compare "
                             "--router choices against one replica holding it all (hybridserve/sim/routing.py)")
    parser.add_argument("--router", default=",".join(ROUTERS),
                        help=f"comma-separated routers with --replicas: {', '.join(ROUTERS)}")
    parser.add_argument("--summary-period-s", type=float, default=1.0,
                        help="trace seconds between the replicas' joint-boundary summaries (the router's staleness)")
    parser.add_argument("--utilization", type=float, default=0.7,
                        help="replica service rate: the trace's cold work keeps all replicas this busy on average")
    parser.add_argument("--load-half-life-s", type=float, default=LOAD_HALF_LIFE_S,
                        help="a replica's load is its queued work plus the work sent to it recently, decayed with "
                             "this half-life (trace seconds; 0: queued work only)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(handler=run_sim)


def _floats(text: str, what: str, zero_ok: bool = False) -> list[float]:
    """Comma-separated positive numbers (`zero_ok`: >= 0, a tier budget of 0 meaning no such tier)."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not values or any(v < 0 or (v == 0 and not zero_ok) for v in values):
        raise ValueError(f"{what} must be {'numbers >= 0' if zero_ok else 'positive numbers'}, got {text!r}")
    return values


def run_sim(args: argparse.Namespace) -> int:
    """Parse flags, replay, print the table; write JSON and the plot when asked."""
    from hybridserve.sim.bound import hit_options, slot_bound_hit_tokens
    from hybridserve.sim.links import Link
    from hybridserve.sim.oracle import ORACLE, learn_restores, simulate_oracle
    from hybridserve.sim.shapes import model_shape
    from hybridserve.sim.simulator import SimConfig, ceiling_hit_tokens, simulate
    from hybridserve.sim.trace import TraceTokens, read_trace

    policies = known_names(args.policies, POLICY_NAMES, "cache policy")
    snapshot_budgets = _floats(args.snapshot_budgets_gib, "--snapshot-budgets-gib")
    kv_budgets = _floats(args.kv_budgets_gib, "--kv-budgets-gib")
    tier_budgets = [(host, disk) for host in _floats(args.host_budgets_gib, "--host-budgets-gib", zero_ok=True)
                    for disk in _floats(args.disk_budgets_gib, "--disk-budgets-gib", zero_ok=True)]
    links = [Link(args.host_bandwidth_gbs * 1e9, args.host_latency_us * 1e-6),
             Link(args.disk_bandwidth_gbs * 1e9, args.disk_latency_us * 1e-6)]
    if min(args.host_bandwidth_gbs, args.disk_bandwidth_gbs, args.prefill_tflops) <= 0 \
            or min(args.host_latency_us, args.disk_latency_us) < 0:
        raise ValueError("bandwidths and --prefill-tflops must be positive, latencies >= 0")
    if args.block_size < 1 or args.snapshot_interval < 1 or args.snapshot_interval % args.block_size:
        raise ValueError("--snapshot-interval must be a positive multiple of --block-size")
    shape = model_shape(args.model_shape)
    if args.workload:
        from hybridserve.sim.workloads import workload_records

        records = workload_records(args.workload, args.num_requests, args.block_tokens, args.workload_seed)
    else:
        records = read_trace(args.trace, args.num_requests, args.block_tokens)
    tokens = TraceTokens(records, args.block_tokens, shape.config.vocab_size)
    if args.replicas != 1:
        return run_routing(args, shape, tokens, policies[0], snapshot_budgets, kv_budgets, tier_budgets, links)
    start = time.perf_counter()
    ceiling, prompt_tokens = ceiling_hit_tokens(tokens)
    print(f"[sim] {len(records)} requests, {prompt_tokens} prompt tokens, tokens built in "
          f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    options = hit_options(tokens)
    results = []
    for kv in kv_budgets:
        restores = None
        for host, disk in tier_budgets:
            base = SimConfig(ORACLE, int(kv * GIB), int(snapshot_budgets[0] * GIB), args.block_size,
                             args.snapshot_interval, int(host * GIB), int(disk * GIB), links[0], links[1],
                             args.tier_write_policy == "write-through")
            for policy in policies:
                for budget in snapshot_budgets:
                    config = base._replace(policy=policy, snapshot_bytes=int(budget * GIB))
                    results.append(_reported(simulate(tokens, shape, config, progress=not args.no_progress)))
            if args.oracle:
                if restores is None:  # which requests restore each state: from a device-only replay
                    restores = learn_restores(tokens, shape, base._replace(host_bytes=0, disk_bytes=0),
                                              progress=not args.no_progress)
                for budget in snapshot_budgets:
                    results.append(_reported(simulate_oracle(tokens, shape, base._replace(
                        snapshot_bytes=int(budget * GIB)), restores, progress=not args.no_progress)))
    bounds = {r.snapshot_slots: slot_bound_hit_tokens(options, r.snapshot_slots) / prompt_tokens for r in results}
    report = sim_report(args, shape, len(records), ceiling / prompt_tokens, results, bounds, args.prefill_tflops * 1e12)
    print(format_sim_report(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    if args.plot:
        plot_hit_rates(report, args.plot)
    return 0


def _reported(result: SimResult) -> SimResult:
    """`result`, its line printed to stderr."""
    config = result.config
    tiers = f", host {config.host_bytes / GIB:g} GiB, disk {config.disk_bytes / GIB:g} GiB" \
        if config.host_bytes or config.disk_bytes else ""
    print(f"[sim] {config.policy} KV {config.kv_bytes / GIB:g} GiB, snapshots {config.snapshot_bytes / GIB:g} GiB"
          f"{tiers}: {result.hit_rate:.2%} ({result.seconds:.1f} s)", file=sys.stderr, flush=True)
    return result


def sim_report(args: argparse.Namespace, shape: ModelShape, num_requests: int, ceiling: float,
               results: list[SimResult], bounds: dict[int, float], prefill_flops: float) -> dict[str, Any]:
    """Everything the run measured, JSON-ready (`bounds`: slot count -> clairvoyant bound;
    `prefill_flops`: the FLOP/s that turns saved FLOPs into seconds)."""
    rows = [{
        "policy": r.config.policy, "kv_budget_gib": r.config.kv_bytes / GIB,
        "snapshot_budget_gib": r.config.snapshot_bytes / GIB, "host_budget_gib": r.config.host_bytes / GIB,
        "disk_budget_gib": r.config.disk_bytes / GIB, "hit_tokens_by_tier": dict(r.tier_hit_tokens),
        "prefill_seconds_saved": r.saved_flops / prefill_flops, "promotion_seconds": r.promotion_seconds,
        "demotion_seconds": r.demotion_seconds,
        "net_seconds_saved": r.saved_flops / prefill_flops - r.promotion_seconds, "kv_blocks": r.kv_blocks,
        "snapshot_slots": r.snapshot_slots, "requests": r.requests, "skipped": r.skipped,
        "token_hit_rate": r.hit_rate,
        # the bound counts device slots only: it does not apply once a lower tier keeps states too
        "slot_bound_token_hit_rate": None if r.config.host_bytes or r.config.disk_bytes else bounds[r.snapshot_slots],
        "request_hit_share": r.hit_requests / max(r.requests, 1),
        "prefill_flops_saved_share": r.saved_flops / max(r.prefill_flops, 1.0),
        "snapshot_evictions": r.snapshot_evictions, "kv_evictions": r.kv_evictions,
        "snapshots_published": r.snapshots_published, "seconds": r.seconds,
    } for r in results]
    trace = f"workload:{args.workload}:seed={args.workload_seed}" if args.workload else args.trace
    return {"trace": trace, "num_requests": num_requests, "model_shape": shape.name,
            "kv_bytes_per_token": shape.cost.kv_bytes_per_token, "snapshot_bytes": shape.cost.snapshot_bytes,
            "block_size": args.block_size, "snapshot_interval": args.snapshot_interval,
            "block_tokens": args.block_tokens, "ceiling_token_hit_rate": ceiling,
            "prefill_tflops": prefill_flops / 1e12, "rows": rows}


COLUMNS = (
    ("policy", "cache policy (oracle: the clairvoyant reference, not a policy)"),
    ("KV GiB", "device KV budget"),
    ("snap GiB", "device GDN snapshot budget (slots = budget / snapshot size)"),
    ("host/disk", "lower-tier budgets, GiB (0: none); each holds joint entries (state + prefix KV)"),
    ("token hit", "prompt tokens restored from the cache / all prompt tokens"),
    ("of ceiling", "token hit / the unbounded ceiling (a cache that keeps every computed state)"),
    ("slot bound", "the most any policy with that many device slots can hit (bound.py; '-' with lower tiers)"),
    ("req hit", "requests restoring anything / all requests (a hit of 1 block counts as much as 100)"),
    ("dev/host/disk", "token hits by the tier the state came from, % of prompt tokens"),
    ("net s saved", "prefill seconds the hits save at --prefill-tflops, minus every promotion's transfer time"),
    ("snap evict", "device snapshots evicted (to a lower tier when there is one)"),
    ("KV evict", "device KV blocks reclaimed"),
)
SERVER_DEFAULTS = ("defaults that differ from `hybridserve serve`: KV budget 1024 GiB (the server sizes it from "
                   "memory), block 64 tokens (server 16), snapshot budgets 1..64 GiB (server: half the cache "
                   "memory), no lower tiers unless --host/--disk-budgets-gib are given")


def format_sim_report(report: dict[str, Any]) -> str:
    """The table `hybridserve sim` prints: a legend, one row per replay, one summary line per policy."""
    ceiling = report["ceiling_token_hit_rate"]
    lines = [f"{report['num_requests']} requests, shape {report['model_shape']} "
             f"({report['kv_bytes_per_token']} B KV/token, {report['snapshot_bytes'] / 2**20:.1f} MiB/snapshot), "
             f"block {report['block_size']}, {report['block_tokens']} tokens per trace block; "
             f"unbounded ceiling {ceiling:.1%} of prompt tokens",
             SERVER_DEFAULTS + ".", "columns:"]
    lines += [f"  {name:>13}: {meaning}" for name, meaning in COLUMNS]
    widths = [11, 7, 8, 11, 9, 10, 10, 7, 20, 11, 10, 9]
    lines.append("  ".join(f"{name:>{w}}" for (name, _), w in zip(COLUMNS, widths)))
    for row in report["rows"]:
        by_tier = row["hit_tokens_by_tier"]
        total = sum(by_tier.values())
        shares = "/".join(f"{row['token_hit_rate'] * by_tier.get(t, 0) / total:.1%}" if total else "0"
                          for t in ("device", "host", "disk"))
        cells = [row["policy"], f"{row['kv_budget_gib']:g}", f"{row['snapshot_budget_gib']:g}",
                 f"{row['host_budget_gib']:g}/{row['disk_budget_gib']:g}", f"{row['token_hit_rate']:.2%}",
                 f"{row['token_hit_rate'] / ceiling:.1%}" if ceiling else "-",
                 "-" if row["slot_bound_token_hit_rate"] is None else f"{row['slot_bound_token_hit_rate']:.2%}",
                 f"{row['request_hit_share']:.1%}", shares,
                 f"{row['net_seconds_saved']:.1f}", str(row["snapshot_evictions"]), str(row["kv_evictions"])]
        lines.append("  ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    lines.append("summary:")
    for policy in dict.fromkeys(row["policy"] for row in report["rows"]):
        rows = [row for row in report["rows"] if row["policy"] == policy]
        best = max(rows, key=lambda row: row["token_hit_rate"])
        reach = [row for row in rows if ceiling and row["token_hit_rate"] >= 0.95 * ceiling]
        first = min(reach, key=lambda row: (row["snapshot_budget_gib"], row["host_budget_gib"], row["disk_budget_gib"]),
                    default=None)
        at = (f"first reaches 95% of the ceiling at {_setup(first)}" if first is not None
              else "never reaches 95% of the ceiling")
        lines.append(f"  {policy}: best {best['token_hit_rate']:.2%} of prompt tokens "
                     f"({best['token_hit_rate'] / ceiling:.1%} of the ceiling) at {_setup(best)}; {at}"
                     if ceiling else f"  {policy}: best {best['token_hit_rate']:.2%} at {_setup(best)}")
    return "\n".join(lines)


def _setup(row: dict[str, Any]) -> str:
    tiers = f" + host {row['host_budget_gib']:g} + disk {row['disk_budget_gib']:g} GiB" \
        if row["host_budget_gib"] or row["disk_budget_gib"] else ""
    return f"{row['snapshot_budget_gib']:g} GiB snapshots{tiers} (KV {row['kv_budget_gib']:g} GiB)"


def plot_hit_rates(report: dict[str, Any], path: str) -> None:
    """Token hit rate vs snapshot budget, one line per policy (and KV budget), ceiling dashed."""
    import matplotlib

    from hybridserve.sim.oracle import ORACLE

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[tuple[float, float]]] = {}
    kv_budgets = {row["kv_budget_gib"] for row in report["rows"]}
    for row in report["rows"]:
        label = row["policy"] + (f" (KV {row['kv_budget_gib']:g} GiB)" if len(kv_budgets) > 1 else "")
        series.setdefault(label, []).append((row["snapshot_budget_gib"], row["token_hit_rate"]))
    for label, points in series.items():
        points.sort()
        style = ":" if label.startswith(ORACLE) else "-"  # a reference, not a policy
        axes.plot([p[0] for p in points], [100 * p[1] for p in points], marker="o", linestyle=style, label=label)
    axes.axhline(100 * report["ceiling_token_hit_rate"], color="grey", linestyle="--", label="unbounded ceiling")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("GDN snapshot budget (GiB)")
    axes.set_ylabel("token hit rate (% of prompt tokens)")
    axes.set_title(f"{report['model_shape']}, {report['num_requests']} requests")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)

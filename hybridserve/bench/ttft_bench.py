"""`hybridserve bench ttft`: time to first token with the joint prefix cache off vs on.

For each cached size N, a prompt is N fixed random tokens plus a fresh suffix that the cache-on
engine has seen once. Cold, warm and the floor (a cold prompt of the suffix alone) alternate per
iteration; a no-reuse throughput run compares on vs off.
"""

from __future__ import annotations

from typing import Any

from hybridserve.bench import common
from hybridserve.bench.configs import TTFTBenchConfig
from hybridserve.config import EngineConfig
from hybridserve.engine.engine import LLMEngine

WARM_COLD_GOAL = 0.03      # warm/cold TTFT at the longest row
FLAT_GOAL = 1.10           # slowest warm row / fastest warm row
FLOOR_GOAL = 1.2           # warm TTFT / floor TTFT
THROUGHPUT_GOAL = 0.97     # no-reuse throughput, cache on / cache off


def _seed(cfg: TTFTBenchConfig, purpose: int, major: int, minor: int = 0, scale: int = 1000) -> int:
    """A prompt seed of its own per purpose (1 prefix, 2 suffix, 3 floor, 4 throughput) and index."""
    return cfg.seed * 1_000_000_007 + purpose * 10_000_000 + major * scale + minor


def _measure_row(off: common.EngineDriver, on: common.EngineDriver, cached: int, cfg: TTFTBenchConfig,
                 vocab: int) -> dict[str, Any]:
    """Cold, warm and floor samples for prompts of `cached` + suffix tokens."""
    prefix = common.random_token_ids(cached, _seed(cfg, 1, cached, scale=1), vocab)

    def prompt(i: int) -> list[int]:
        return prefix + common.random_token_ids(cfg.suffix_tokens, _seed(cfg, 2, cached, i), vocab)

    on.run(prompt(-1), common.greedy(1))  # seeding: the only time "on" computes this prefix
    for w in range(cfg.warmup):
        on.run(prompt(-2 - w), common.greedy(1))
    row: dict[str, Any] = {"cached": cached, "prompt_tokens": cached + cfg.suffix_tokens,
                           "cold_s": [], "warm_s": [], "floor_s": [], "warm_cached_tokens": [],
                           "cold_cached_tokens": []}
    for i in range(cfg.iterations):
        runs = {"cold": (off, prompt(i)), "warm": (on, prompt(i)),
                "floor": (off, common.random_token_ids(cfg.suffix_tokens, _seed(cfg, 3, cached, i), vocab))}
        for kind in common.alternate(list(runs), i):
            driver, ids = runs[kind]
            result = driver.run(ids, common.greedy(1))
            row[f"{kind}_s"].append(result.ttft_s)
            if kind != "floor":
                row[f"{kind}_cached_tokens"].append(result.output.num_cached_tokens)
    return row


def _measure_throughput(off: common.EngineDriver, on: common.EngineDriver, cfg: TTFTBenchConfig,
                        vocab: int) -> dict[str, Any]:
    """No-reuse workload, ABBA order per round; every run uses prompts never seen before."""
    times: dict[str, list[float]] = {"off": [], "on": []}
    hits = 0
    params = common.greedy(cfg.throughput_output_tokens)
    for run, name in enumerate(("off", "on", "on", "off") * cfg.throughput_rounds):
        prompts = [common.random_token_ids(cfg.throughput_prompt_tokens, _seed(cfg, 4, run, j, scale=10_000), vocab)
                   for j in range(cfg.throughput_requests)]
        elapsed, outputs = (off if name == "off" else on).run_batch(prompts, params)
        times[name].append(elapsed)
        hits += sum(o.num_cached_tokens for o in outputs)
    tokens = cfg.throughput_requests * cfg.throughput_output_tokens
    off_tps, on_tps = tokens / common.median(times["off"]), tokens / common.median(times["on"])
    return {"off_s": times["off"], "on_s": times["on"], "off_output_tokens_per_s": off_tps,
            "on_output_tokens_per_s": on_tps, "on_over_off": on_tps / off_tps, "cached_tokens": hits,
            "goal": THROUGHPUT_GOAL, "met": on_tps / off_tps >= THROUGHPUT_GOAL}


def run_ttft_bench(engine_config: EngineConfig, cfg: TTFTBenchConfig) -> dict[str, Any]:
    """Measure every row, the floor and the throughput; returns figures and goal checks."""
    on_engine, off_engine = (LLMEngine(config) for config in common.cache_on_off(engine_config))
    off, on = common.EngineDriver(off_engine, "off"), common.EngineDriver(on_engine, "on")
    vocab = on_engine.model_config.vocab_size
    for driver in (off, on):  # warm-up of both engines' code paths on a throwaway prompt
        warmup = common.random_token_ids(cfg.suffix_tokens + min(cfg.cached_tokens), _seed(cfg, 3, -1), vocab)
        driver.run(warmup, common.greedy(2))
    rows = [_measure_row(off, on, cached, cfg, vocab) for cached in cfg.cached_tokens]
    throughput = _measure_throughput(off, on, cfg, vocab)
    common.finish(off_engine, on_engine)
    return _summarize(rows, throughput, cfg, on_engine)


def _summarize(rows: list[dict[str, Any]], throughput: dict[str, Any], cfg: TTFTBenchConfig,
               on_engine: LLMEngine) -> dict[str, Any]:
    floor = common.median(s for row in rows for s in row["floor_s"])
    for row in rows:
        row["cold_p50_s"], row["warm_p50_s"] = common.median(row["cold_s"]), common.median(row["warm_s"])
        row["floor_p50_s"] = common.median(row["floor_s"])  # measured interleaved with this row: same noise
        row["warm_over_cold"] = row["warm_p50_s"] / row["cold_p50_s"]
        row["warm_over_floor"] = row["warm_p50_s"] / row["floor_p50_s"]
    warm = [row["warm_p50_s"] for row in rows]
    worst_floor = max(row["warm_over_floor"] for row in rows)
    longest = max(rows, key=lambda row: row["cached"])
    goals = {
        "warm_over_cold_longest": {"value": longest["warm_over_cold"], "goal": WARM_COLD_GOAL,
                                   "met": longest["warm_over_cold"] <= WARM_COLD_GOAL},
        "warm_spread": {"value": max(warm) / min(warm), "goal": FLAT_GOAL, "met": max(warm) / min(warm) <= FLAT_GOAL},
        "warm_over_floor_max": {"value": worst_floor, "goal": FLOOR_GOAL, "met": worst_floor <= FLOOR_GOAL},
        "throughput_on_over_off": {"value": throughput["on_over_off"], "goal": THROUGHPUT_GOAL,
                                   "met": throughput["met"]},
    }
    return common.result_header(cfg, on_engine) | {"rows": rows, "floor_p50_s": floor, "throughput": throughput,
                                                   "goals": goals,
                                                   "prefix_cache": on_engine.prefix_cache_stats()._asdict()}


def format_ttft_report(result: dict[str, Any]) -> str:
    """The result tables printed by `bench ttft`."""
    cfg = result["config"]
    rows = [[row["prompt_tokens"], row["cached"], f"{1e3 * row['cold_p50_s']:.0f}", f"{1e3 * row['warm_p50_s']:.1f}",
             f"{1e3 * row['floor_p50_s']:.1f}", f"{row['warm_over_cold']:.4f}", f"{row['warm_over_floor']:.2f}",
             _distinct(row["cold_cached_tokens"]), _distinct(row["warm_cached_tokens"])] for row in result["rows"]]
    table = common.format_table(["prompt", "cached", "cold p50 ms", "warm p50 ms", "floor p50 ms", "warm/cold",
                                 "warm/floor", "cold num_cached", "warm num_cached"], rows)
    goals = [[name, f"{g['value']:.4f}", f"{'>=' if name.startswith('throughput') else '<='} {g['goal']}",
              common.goal_mark(g["met"])] for name, g in result["goals"].items()]
    tp = result["throughput"]
    lines = [
        table,
        f"floor: cold TTFT of a {cfg['suffix_tokens']}-token prompt (the suffix alone), measured within each row; "
        f"p50 over all rows {1e3 * result['floor_p50_s']:.1f} ms",
        f"no-reuse throughput ({cfg['throughput_requests']} x {cfg['throughput_prompt_tokens']}-token prompts, "
        f"{cfg['throughput_output_tokens']} output tokens each): off {tp['off_output_tokens_per_s']:.1f} tok/s, "
        f"on {tp['on_output_tokens_per_s']:.1f} tok/s, on/off {tp['on_over_off']:.3f} "
        f"(cached tokens {tp['cached_tokens']})",
        common.format_table(["goal", "value", "target", "status"], goals),
        f"engine (on): {result['engine']}\nmachine: {result['machine']}; p50 of {cfg['iterations']} iterations, "
        f"{cfg['warmup']} extra warm-up(s) per row, engines alternated",
    ]
    return "\n".join(lines)


def _distinct(values: list[int]) -> str:
    return ",".join(str(v) for v in sorted(set(values)))


def plot_ttft(result: dict[str, Any], path: str) -> None:
    """Bar chart of cold vs warm p50 TTFT per row with the floor as a line (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{row['prompt_tokens']}\n({row['cached']} cached)" for row in rows]
    positions = range(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar([p - 0.2 for p in positions], [1e3 * r["cold_p50_s"] for r in rows], 0.4, label="cache off (cold)")
    ax.bar([p + 0.2 for p in positions], [1e3 * r["warm_p50_s"] for r in rows], 0.4, label="cache on (warm)")
    ax.axhline(1e3 * result["floor_p50_s"], color="gray", linestyle="--", label="floor (suffix alone)")
    ax.set_yscale("log")
    ax.set_xticks(list(positions), labels)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT p50 (ms, log scale)")
    ax.set_title("hybridserve TTFT, joint prefix cache off vs on")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

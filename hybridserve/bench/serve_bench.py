"""`hybridserve bench serve`: load test of a live OpenAI-compatible server (a `hybridserve serve`
subprocess, or `--url`) with streamed greedy `/v1/completions` at each concurrency level, for a
shared-prefix and a no-reuse workload. The mixed-load run injects a long warm request into decoding
background streams and compares their ITL p99 during it with their p50 before.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from hybridserve.bench.common import format_table, goal_mark
from hybridserve.bench.configs import ServeBenchConfig
from hybridserve.bench.serve_client import CompletionClient, PromptSource, RequestRecord, ServerProcess, percentile

MIXED_ITL_GOAL = 3.0         # background ITL p99 under injection / their baseline ITL p50
POLL_S = 0.005               # controller polling period of the mixed case


def _ms(seconds: float) -> float:
    return round(1000.0 * seconds, 3) if math.isfinite(seconds) else float("nan")


def summarize(records: Sequence[RequestRecord], wall_s: float) -> dict[str, Any]:
    """Latency percentiles, rates and cache share of one (workload, concurrency) run."""
    ok = [r for r in records if r.error is None]
    itl = [b - a for r in ok for a, b in r.gaps()]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.completion_tokens for r in ok)
    return {
        "requests": len(records), "errors": len(records) - len(ok),
        "first_error": next((r.error for r in records if r.error), None),
        "wall_s": round(wall_s, 3),
        "ttft_p50_ms": _ms(percentile([r.ttft for r in ok], 50)),
        "ttft_p99_ms": _ms(percentile([r.ttft for r in ok], 99)),
        "itl_p50_ms": _ms(percentile(itl, 50)), "itl_p99_ms": _ms(percentile(itl, 99)),
        "requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else float("nan"),
        "output_tokens_per_s": round(output / wall_s, 1) if wall_s > 0 else float("nan"),
        "prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": output,
        "cached_share": round(cached / prompt, 4) if prompt else float("nan"),
    }


async def run_level(api: CompletionClient, prompts: Sequence[list[int]], concurrency: int, max_tokens: int,
                    timeout_s: float) -> tuple[list[RequestRecord], float]:
    """`concurrency` clients take prompts from a shared list back to back until `timeout_s`; the
    records and the wall time."""
    queue = list(reversed(prompts))
    records: list[RequestRecord] = []
    start = time.perf_counter()
    deadline = start + timeout_s

    async def client_loop() -> None:
        while queue and time.perf_counter() < deadline:
            records.append(await api.stream(queue.pop(), max_tokens))

    await asyncio.gather(*(client_loop() for _ in range(max(1, min(concurrency, len(prompts))))))
    return records, time.perf_counter() - start


def workload_prompts(kind: str, source: PromptSource, prefix: list[int], cfg: ServeBenchConfig) -> list[list[int]]:
    """`cfg.num_requests` prompts of one workload (the shared prefix is only used by shared-prefix)."""
    if kind == "shared-prefix":
        return [prefix + source.fresh(cfg.suffix_tokens) for _ in range(cfg.num_requests)]
    return [source.fresh(cfg.prefix_tokens + cfg.suffix_tokens) for _ in range(cfg.num_requests)]


async def run_workload(api: CompletionClient, kind: str, source: PromptSource,
                       cfg: ServeBenchConfig) -> list[dict[str, Any]]:
    """One row per concurrency level; one unmeasured request first (warms the prefix / the server)."""
    prefix = source.fresh(cfg.prefix_tokens)
    warm = await api.stream(workload_prompts(kind, source, prefix, replace(cfg, num_requests=1))[0], 1)
    if warm.error:
        raise RuntimeError(f"warm-up request failed: {warm.error}")
    rows = []
    for level in cfg.concurrency:
        prompts = workload_prompts(kind, source, prefix, cfg)
        records, wall = await run_level(api, prompts, level, cfg.max_tokens, cfg.level_timeout_s)
        rows.append({"workload": kind, "concurrency": level, **summarize(records, wall)})
        print(f"[bench] {kind} c={level}: {rows[-1]['requests']} requests in {wall:.1f} s", file=sys.stderr)
    return rows


def _background_ready(records: Sequence[RequestRecord], tasks: Sequence[asyncio.Task[Any]], need: int) -> bool:
    if any(task.done() for task in tasks):
        raise RuntimeError("mixed case: a background request ended before the injection "
                           f"(error: {next((r.error for r in records if r.error), None)}); raise its max_tokens")
    if not all(r.chunk_times for r in records):
        return False
    started = max(r.chunk_times[0] for r in records)
    return all(sum(t > started for t in r.chunk_times) >= need for r in records)


def mixed_summary(background: Sequence[RequestRecord], injected: RequestRecord, warm: RequestRecord) -> dict[str, Any]:
    """Background ITL before vs during the injection window, and the injected request's figures."""
    started = max(r.chunk_times[0] for r in background)
    window_end = injected.chunk_times[-1] if injected.chunk_times else injected.end
    gaps = [(a, b) for r in background for a, b in r.gaps()]
    baseline = [b - a for a, b in gaps if a >= started and b <= injected.start]
    during = [b - a for a, b in gaps if b > injected.start and a < window_end]
    base_p50, inj_p99 = percentile(baseline, 50), percentile(during, 99)
    ratio = inj_p99 / base_p50 if baseline and during and base_p50 > 0 else float("nan")
    return {
        "background": len(background), "baseline_gaps": len(baseline), "injection_gaps": len(during),
        "baseline_itl_p50_ms": _ms(base_p50), "injection_itl_p99_ms": _ms(inj_p99),
        "injection_itl_max_ms": _ms(max(during, default=float("nan"))),
        "injection_window_ms": _ms(window_end - injected.start),
        "itl_ratio": round(ratio, 3) if math.isfinite(ratio) else float("nan"),
        "goal_ratio": MIXED_ITL_GOAL, "goal_met": bool(ratio <= MIXED_ITL_GOAL) if math.isfinite(ratio) else None,
        "injected_ttft_ms": _ms(injected.ttft), "injected_prompt_tokens": injected.prompt_tokens,
        "injected_cached_tokens": injected.cached_tokens, "injected_error": injected.error,
        "warmup_ttft_ms": _ms(warm.ttft), "warmup_cached_tokens": warm.cached_tokens,
    }


async def run_mixed(api: CompletionClient, source: PromptSource, cfg: ServeBenchConfig) -> dict[str, Any]:
    """Warm the long prefix, start the background decoders, inject the long request, then cancel them."""
    prefix = source.fresh(cfg.mixed_prefix_tokens)
    warm = await api.stream(prefix + source.fresh(cfg.mixed_suffix_tokens), 1)
    if warm.error:
        raise RuntimeError(f"mixed case: warm-up request failed: {warm.error}")
    background = [RequestRecord() for _ in range(cfg.mixed_background)]
    tasks = [asyncio.create_task(api.stream(source.fresh(cfg.mixed_background_prompt_tokens),
                                            cfg.mixed_background_max_tokens, record)) for record in background]
    try:
        deadline = time.perf_counter() + cfg.request_timeout_s
        while not _background_ready(background, tasks, cfg.mixed_baseline_chunks):
            if time.perf_counter() > deadline:
                raise TimeoutError("mixed case: timed out waiting for the background baseline")
            await asyncio.sleep(POLL_S)
        injected = await api.stream(prefix + source.fresh(cfg.mixed_suffix_tokens), cfg.mixed_max_tokens)
        if any(task.done() for task in tasks):
            print("[bench] mixed case: a background request ended inside the injection window; "
                  "raise --mixed-background-max-tokens", file=sys.stderr)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return mixed_summary(background, injected, warm)


async def run_against(url: str, cfg: ServeBenchConfig, api_key: str | None = None) -> dict[str, Any]:
    """All workloads and the mixed case against the server at `url`."""
    most = max([*cfg.concurrency, cfg.mixed_background + 1]) + 4
    async with CompletionClient(url, "httpx", most, cfg.token_logprobs, cfg.request_timeout_s, api_key) as api:
        source = PromptSource(cfg.seed)
        rows = [row for kind in cfg.workloads for row in await run_workload(api, kind, source, cfg)]
        mixed = await run_mixed(api, source, cfg) if cfg.mixed else None
    return {"url": url, "model": api.model, "config": asdict(cfg), "rows": rows, "mixed": mixed}


def run_serve_bench(cfg: ServeBenchConfig, *, url: str | None = None, serve_args: Sequence[str] = (),
                    api_key: str | None = None) -> dict[str, Any]:
    """Run the benchmark against `url`, or against a `hybridserve serve` subprocess started with
    `serve_args` (and stopped afterwards) when `url` is None."""
    if url is not None:
        return asyncio.run(run_against(url.rstrip("/"), cfg, api_key)) | {"server": {"started": False}}
    with ServerProcess(serve_args) as server:
        result = asyncio.run(run_against(server.url, cfg, api_key))
        return result | {"server": {"started": True, "argv": server.argv[2:]}}


def _fmt(value: Any, digits: int = 1) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def _share(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:.1f}%"


def format_serve_report(result: dict[str, Any]) -> str:
    """The workload table and the mixed-load lines."""
    headers = ["workload", "conc", "reqs", "err", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
               "req/s", "out tok/s", "cached"]
    rows = [[r["workload"], r["concurrency"], r["requests"], r["errors"], _fmt(r["ttft_p50_ms"]),
             _fmt(r["ttft_p99_ms"]), _fmt(r["itl_p50_ms"]), _fmt(r["itl_p99_ms"]), _fmt(r["requests_per_s"], 2),
             _fmt(r["output_tokens_per_s"]), _share(r["cached_share"])] for r in result["rows"]]
    cfg = result["config"]
    lines = [f"hybridserve bench serve: {result['url']} (model {result['model']}), prompts "
             f"{cfg['prefix_tokens']}+{cfg['suffix_tokens']} tokens, max_tokens {cfg['max_tokens']}, "
             f"{cfg['num_requests']} requests per level", format_table(headers, rows)]
    errors = [r for r in result["rows"] if r["first_error"]]
    lines += [f"  first error ({r['workload']}, c={r['concurrency']}): {r['first_error']}" for r in errors]
    mixed = result.get("mixed")
    if mixed:
        lines += [
            f"mixed load ({mixed['background']} background decoders, injected prompt "
            f"{mixed['injected_prompt_tokens']} tokens, {mixed['injected_cached_tokens']} cached):",
            f"  background ITL p50 before {_fmt(mixed['baseline_itl_p50_ms'])} ms ({mixed['baseline_gaps']} gaps), "
            f"p99 during injection {_fmt(mixed['injection_itl_p99_ms'])} ms ({mixed['injection_gaps']} gaps, "
            f"max {_fmt(mixed['injection_itl_max_ms'])} ms, window {_fmt(mixed['injection_window_ms'])} ms)",
            f"  ratio {_fmt(mixed['itl_ratio'], 2)}x (goal <= {MIXED_ITL_GOAL:g}x): {goal_mark(mixed['goal_met'])}; "
            f"injected TTFT {_fmt(mixed['injected_ttft_ms'])} ms (its warm-up: "
            f"{_fmt(mixed['warmup_ttft_ms'])} ms, {mixed['warmup_cached_tokens']} cached)",
        ]
        if mixed["injected_error"]:
            lines.append(f"  injected request error: {mixed['injected_error']}")
    return "\n".join(lines)


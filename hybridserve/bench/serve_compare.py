"""`hybridserve bench serve --compare-offline`: the server against `LLM.generate`, in one run.
The same requests go through `LLM.generate` and a `hybridserve serve` subprocess per
`--engine-process` mode and HTTP client, in turns: batch-1 decode ms/token (a 1 + D token request
minus a 1-token one, over D), warm TTFT of a long prefix, and output tokens/s of concurrent streams.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, TypeAlias

from hybridserve.bench.common import format_table, goal_mark, greedy, measured_rounds, median
from hybridserve.bench.configs import CompareConfig
from hybridserve.bench.serve_client import PromptSource, ServerBackend, ServerProcess

DECODE_GOAL = 1.05
TTFT_GOAL_MS = 5.0
THROUGHPUT_GOAL = 0.9


class OfflineBackend:
    """`LLM.generate` in this process, measured as `ServerBackend` measures a server."""

    def __init__(self, config: Any) -> None:
        from hybridserve.api import LLM

        self.llm = LLM.from_config(config)

    def one(self, prompt: list[int], max_tokens: int) -> tuple[float, float]:
        start = time.perf_counter()
        self.llm.generate([prompt], greedy(max_tokens), use_tqdm=False)
        wall = time.perf_counter() - start
        return wall, wall

    def batch(self, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
        start = time.perf_counter()
        outs = self.llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
        wall = time.perf_counter() - start
        return sum(len(c.token_ids) for o in outs for c in o.outputs), wall


Backend: TypeAlias = OfflineBackend | ServerBackend


class _Figures:
    """The three measures of one backend, with a prompt seed of its own (two clients of one server
    would otherwise hit each other's prompts in its prefix cache)."""

    def __init__(self, backend: Backend, cfg: CompareConfig, source: int) -> None:
        self.backend = backend
        self.cfg = cfg
        self.prompts = PromptSource(cfg.seed * 1000 + source)
        self.prefix = self.prompts.fresh(cfg.ttft_prefix_tokens)
        backend.one(self.prefix + self.prompts.fresh(cfg.ttft_suffix_tokens), 1)  # makes the prefix warm

    def decode_ms(self) -> float:
        cfg = self.cfg
        _, short = self.backend.one(self.prompts.fresh(cfg.decode_prompt_tokens), 1)
        _, long = self.backend.one(self.prompts.fresh(cfg.decode_prompt_tokens), 1 + cfg.decode_tokens)
        return 1000.0 * (long - short) / cfg.decode_tokens

    def ttft_ms(self) -> float:
        return 1000.0 * self.backend.one(self.prefix + self.prompts.fresh(self.cfg.ttft_suffix_tokens), 1)[0]

    def tokens_per_s(self) -> float:
        batch = [self.prompts.fresh(self.cfg.client_prompt_tokens) for _ in range(self.cfg.clients)]
        tokens, wall = self.backend.batch(batch, self.cfg.client_max_tokens)
        return tokens / wall


def measure_interleaved(backends: dict[str, Backend], cfg: CompareConfig) -> dict[str, dict[str, Any]]:
    """Every figure of every backend; the backends take turns run by run, so that load from
    other processes on a shared machine falls on all of them alike."""
    figures = {name: _Figures(backend, cfg, index) for index, (name, backend) in enumerate(backends.items())}
    results: dict[str, dict[str, Any]] = {name: {"runs": {}} for name in backends}
    for key, measure in (("decode", _Figures.decode_ms), ("ttft", _Figures.ttft_ms), ("rate", _Figures.tokens_per_s)):
        runs = measured_rounds(cfg.warmup, cfg.repeats,
                               lambda _: {name: [round(measure(fig), 3)] for name, fig in figures.items()})
        for name in backends:
            results[name]["runs"][key] = runs[name]
    for result in results.values():
        runs = result["runs"]
        result.update(decode_ms_per_token=round(median(runs["decode"]), 3), warm_ttft_ms=round(median(runs["ttft"]), 2),
                      tokens_per_s=round(median(runs["rate"]), 1))
    return results


def run_compare(cfg: CompareConfig, config: Any, serve_args: Sequence[str]) -> dict[str, Any]:
    """`LLM.generate` and one server per mode, measured in turns; every figure with its ratio to
    offline."""
    with contextlib.ExitStack() as stack:
        backends: dict[str, Backend] = {"offline": OfflineBackend(config)}
        for mode in cfg.modes:
            server = stack.enter_context(ServerProcess([*serve_args, "--engine-process", mode]))
            for http_client in cfg.http_clients:
                backend = ServerBackend(server.url, cfg.clients, http_client)
                stack.callback(backend.close)
                backends[f"server-{mode} {http_client}"] = backend
        print(f"[bench] measuring {', '.join(backends)} in turns ...", file=sys.stderr)
        results = measure_interleaved(backends, cfg)
    base = results["offline"]
    for figures in results.values():
        figures["decode_ratio"] = round(figures["decode_ms_per_token"] / base["decode_ms_per_token"], 3)
        figures["ttft_delta_ms"] = round(figures["warm_ttft_ms"] - base["warm_ttft_ms"], 2)
        figures["throughput_ratio"] = round(figures["tokens_per_s"] / base["tokens_per_s"], 3)
    return {"config": asdict(cfg), "results": results}


def format_compare_report(result: dict[str, Any]) -> str:
    """One row per backend, with the goal checks of the server rows."""
    cfg = result["config"]
    headers = ["backend", "decode ms/tok", "x offline", "warm TTFT ms", "+ms", "tok/s @" + str(cfg["clients"]),
               "x offline", "goals (decode, TTFT, tok/s)"]
    rows = []
    for name, f in result["results"].items():
        goals = "-" if name == "offline" else ", ".join(goal_mark(ok) for ok in (
            f["decode_ratio"] <= DECODE_GOAL, f["ttft_delta_ms"] <= TTFT_GOAL_MS,
            f["throughput_ratio"] >= THROUGHPUT_GOAL))
        rows.append([name, f"{f['decode_ms_per_token']:.2f}", f"{f['decode_ratio']:.3f}", f"{f['warm_ttft_ms']:.1f}",
                     f"{f['ttft_delta_ms']:+.1f}", f"{f['tokens_per_s']:.0f}", f"{f['throughput_ratio']:.3f}", goals])
    head = (f"hybridserve bench serve --compare-offline: decode {cfg['decode_tokens']} tokens after a "
            f"{cfg['decode_prompt_tokens']}-token prompt; warm TTFT {cfg['ttft_prefix_tokens']}+"
            f"{cfg['ttft_suffix_tokens']} tokens; {cfg['clients']} streams x {cfg['client_max_tokens']} tokens; "
            f"medians of {cfg['repeats']} (goals: decode <= {DECODE_GOAL}x, TTFT <= +{TTFT_GOAL_MS:g} ms, "
            f"tok/s >= {THROUGHPUT_GOAL}x)")
    return "\n".join([head, format_table(headers, rows)])

"""`hybridserve bench trace`: a scaled replay of the Mooncake conversation trace, cache on vs off,
checked against the simulator. Each 512-token hash block becomes `block_tokens` tokens; a continued
conversation starts with the tokens its earlier turn produced; the two engines step alternately, and
`hybridserve sim` with the engine's pools and policy must predict the same hits, request by request.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch
from tqdm import tqdm

from hybridserve.bench.common import EngineDriver, cache_on_off, finish, format_table, greedy, result_header
from hybridserve.bench.configs import TraceBenchConfig
from hybridserve.cache.policy import PrefixCost
from hybridserve.config import EngineConfig
from hybridserve.engine.engine import LLMEngine
from hybridserve.layers.attention import PagedKVCache
from hybridserve.sampling_params import RequestOutput
from hybridserve.sim.shapes import ModelShape
from hybridserve.sim.simulator import SimConfig, ceiling_hit_tokens, simulate
from hybridserve.sim.trace import TraceTokens, default_trace_path, read_trace


class _Replay:
    """One engine's replay state: feeds requests in order, at most `max_concurrency` at a time,
    and adds up the time of its own steps (so two replays can be stepped alternately)."""

    def __init__(self, engine: LLMEngine, label: str, tokens: TraceTokens, max_concurrency: int) -> None:
        self.engine = engine
        self.driver = EngineDriver(engine, label)
        self.tokens = tokens
        self.max_concurrency = max_concurrency
        self.pending = deque(range(len(tokens.records)))
        self.index_of: dict[str, int] = {}
        self.outputs: list[RequestOutput | None] = [None] * len(tokens.records)
        self.seconds = 0.0

    @property
    def done(self) -> bool:
        return not self.pending and not self.engine.has_unfinished_requests()

    def step(self) -> int:
        """Admit what the concurrency allows and run one engine step; returns requests finished."""
        engine = self.engine
        while self.pending and engine.num_running_requests + engine.num_waiting_requests < self.max_concurrency:
            index = self.pending.popleft()
            prompt = self.tokens.prompt(index)  # built outside the timed region (shared by both engines)
            request_id = self.driver.next_id()
            self.index_of[request_id] = index
            start = time.perf_counter()
            engine.add_request(request_id, prompt, greedy(self.tokens.records[index].output_length))
            self.seconds += time.perf_counter() - start
        start = time.perf_counter()
        outputs = engine.step()
        self.seconds += time.perf_counter() - start
        finished = 0
        for output in outputs:
            if output.finished:
                index = self.index_of[output.request_id]
                self.outputs[index] = output
                if not self.tokens.has_output(index):
                    self.tokens.set_output(index, output.outputs[0].token_ids)
                finished += 1
        return finished


def _replay_alternating(replays: list[_Replay], progress: bool) -> None:
    """Step every unfinished replay in turn until all are done (cancels machine drift)."""
    total = sum(len(r.outputs) for r in replays)
    with tqdm(total=total, desc="trace replay (all engines)", disable=not progress, leave=False) as bar:
        while not all(r.done for r in replays):
            for replay in replays:
                if not replay.done:
                    bar.update(replay.step())


def _run_summary(elapsed: float, outputs: list[RequestOutput], engine: LLMEngine) -> dict[str, Any]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    stats = engine.stats()
    return {"seconds": elapsed, "prompt_tokens": prompt, "cached_tokens": cached, "hit_share": cached / prompt,
            "prefill_tokens_computed": prompt - cached, "preemptions": stats["num_preemptions"],
            "snapshots_published": stats["snapshots_published"], "snapshots_evicted": stats["snapshots_evicted"]}


def simulate_engine(engine: LLMEngine, tokens: TraceTokens) -> list[int]:
    """Per-request hit tokens `hybridserve sim` predicts for `engine`'s model, dtype, pools and policy,
    decoding one token per step as the engine does (requests one at a time)."""
    model, cache = engine.model_config, engine.config.cache
    kv = PagedKVCache.bytes_per_token(len(model.attention_layer_ids), model.num_key_value_heads, model.head_dim,
                                      engine.dtype)
    shape = ModelShape("engine", model, PrefixCost.from_model(model, kv, engine.bytes_per_snapshot))
    config = SimConfig(cache.cache_policy, engine.num_kv_blocks * cache.block_size * shape.cost.kv_bytes_per_token,
                       engine.num_snapshot_slots * shape.cost.snapshot_bytes, cache.block_size, cache.snapshot_interval,
                       host_bytes=cache.host_cache_memory_bytes,
                       write_through=cache.tier_write_policy == "write-through")
    return list(simulate(tokens, shape, config, stepwise=True, check=True).hits)


def run_trace_bench(engine_config: EngineConfig, cfg: TraceBenchConfig) -> dict[str, Any]:
    """Replay the scaled trace with the prefix cache on and off; returns figures and the checks."""
    on_engine, off_engine = (LLMEngine(config) for config in cache_on_off(engine_config))
    path = cfg.trace_path or str(default_trace_path())
    records = read_trace(path, cfg.num_requests, cfg.block_tokens, cfg.max_output_tokens)
    tokens = TraceTokens(records, cfg.block_tokens, on_engine.model_config.vocab_size)
    replays = {label: _Replay(engine, label, tokens, cfg.max_concurrency)
               for label, engine in (("off", off_engine), ("on", on_engine))}
    with torch.inference_mode():
        _replay_alternating(list(replays.values()), cfg.progress)
    runs: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[RequestOutput]] = {}
    for label, replay in replays.items():
        outputs[label] = [o for o in replay.outputs if o is not None]
        assert len(outputs[label]) == len(records)
        runs[label] = _run_summary(replay.seconds, outputs[label], replay.engine)
    ceiling, prompt_tokens = ceiling_hit_tokens(tokens)
    predicted = simulate_engine(on_engine, tokens) if cfg.max_concurrency == 1 else None
    engine_tiers = on_engine.tier_mover is not None  # read before shutdown drops the mover
    finish(off_engine, on_engine)
    live_hits = [o.num_cached_tokens for o in outputs["on"]]
    mismatched = [i for i, (a, b) in enumerate(zip(outputs["on"], outputs["off"]))
                  if a.outputs[0].token_ids != b.outputs[0].token_ids]
    header = result_header(cfg, on_engine)
    return header | {
        "config": header["config"] | {"trace_path": path},
        "num_requests": len(records), "prompt_tokens": prompt_tokens, "ceiling_hit_share": ceiling / prompt_tokens,
        "continuations": sum(tokens.predecessor(i) is not None for i in range(len(records))),
        "cache_policy": on_engine.config.cache.cache_policy, "runs": runs,
        "identical_outputs": len(records) - len(mismatched), "outputs_match": not mismatched,
        "mismatched_requests": mismatched,
        "sim_hit_tokens": None if predicted is None else sum(predicted), "live_hit_tokens": sum(live_hits),
        "engine_tiers": engine_tiers,
        "sim_matches_live": None if predicted is None else predicted == live_hits,
    }


def format_trace_report(result: dict[str, Any]) -> str:
    """The result table printed by `bench trace`."""
    cfg, on, off = result["config"], result["runs"]["on"], result["runs"]["off"]
    rows = [[label, f"{run['hit_share']:.1%}", run["prefill_tokens_computed"], f"{run['seconds']:.1f}",
             run["preemptions"], run["snapshots_evicted"]] for label, run in (("off", off), ("on", on))]
    table = format_table(["cache", "hit share", "prefill tokens computed", "total s", "preemptions",
                          "snapshots evicted"], rows)
    tiers = result["engine_tiers"]
    sim = ("not run (needs --max-concurrency 1)" if result["sim_matches_live"] is None else
           f"{result['sim_hit_tokens']} hit tokens, "
           + ("identical to the live engine, request by request" if result["sim_matches_live"]
              else f"live {result['live_hit_tokens']}: not compared exactly with lower tiers (the sim's transfers "
                   "end at the next step, the engine's when its mover finishes)" if tiers
              else "DIFFERENT from live"))
    return "\n".join([
        f"SCALED replay of the first {result['num_requests']} requests of {cfg['trace_path']}: each 512-token "
        f"hash block -> {cfg['block_tokens']} pseudo-random tokens, output capped at {cfg['max_output_tokens']} "
        f"tokens, max {cfg['max_concurrency']} concurrent, {result['prompt_tokens']} prompt tokens in all, "
        f"{result['continuations']} requests continue an earlier turn; cache policy {result['cache_policy']}; "
        f"engines stepped alternately, time = sum of each engine's own steps",
        table,
        f"unbounded ceiling: {result['ceiling_hit_share']:.1%} of prompt tokens; cache on reached "
        f"{on['hit_share'] / max(result['ceiling_hit_share'], 1e-9):.1%} of it",
        f"hybridserve sim on the same tokens and pool sizes: {sim}",
        f"time on/off: {on['seconds'] / off['seconds']:.3f}; prefill tokens on/off: "
        f"{on['prefill_tokens_computed'] / max(off['prefill_tokens_computed'], 1):.3f}",
        f"greedy outputs identical with cache on and off: {result['identical_outputs']}/{result['num_requests']}"
        + ("" if result["outputs_match"] else f" (differ: requests {result['mismatched_requests'][:20]})"),
        f"engine (on): {result['engine']}\nmachine: {result['machine']}",
    ])


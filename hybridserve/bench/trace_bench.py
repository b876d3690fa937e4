"""`hybridserve bench trace`: a scaled replay of the Mooncake conversation trace, cache on vs off.

Every trace hash id stands for a 512-token block; the replay maps each id to a fixed pseudo-random
block of `block_tokens` tokens seeded by the id (equal ids -> equal tokens), joins a request's
blocks and cuts the result to its scaled input length ceil(input_length * block_tokens / 512).
Output lengths are capped. Requests are replayed in trace order (timestamps ignored), at most
`max_concurrency` at a time, through an engine with the prefix cache on and one with it off; the
two engines are stepped alternately and each one's time is the sum of its own steps.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tqdm import tqdm

from hybridserve.bench.common import FIRST_PLAIN_ID, EngineDriver, format_table, greedy, machine_line, \
    with_prefix_cache
from hybridserve.config import EngineConfig
from hybridserve.engine.engine import LLMEngine
from hybridserve.sampling_params import RequestOutput

TRACE_BLOCK_TOKENS = 512


def default_trace_path() -> Path:
    """`../shared/traces/mooncake_conversation.jsonl` relative to the repository root."""
    repo_root = Path(__file__).resolve().parents[2]
    return repo_root.parent / "shared" / "traces" / "mooncake_conversation.jsonl"


@dataclass(frozen=True)
class TraceBenchConfig:
    """What to replay and how."""

    trace_path: str = ""  # empty: default_trace_path()
    num_requests: int = 200
    block_tokens: int = 32
    max_output_tokens: int = 8
    max_concurrency: int = 1
    progress: bool = True


class TraceRequest(NamedTuple):
    """One trace record, scaled."""

    hash_ids: tuple[int, ...]
    prompt: list[int]
    output_tokens: int


def read_trace(path: str | Path, limit: int) -> list[dict[str, Any]]:
    """The first `limit` records of a Mooncake-format JSONL trace."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if len(records) >= limit:
                break
            if line.strip():
                records.append(json.loads(line))
    return records


class BlockTokens:
    """Maps a trace hash id to its fixed pseudo-random block of tokens (memoised per instance)."""

    def __init__(self, block_tokens: int, vocab_size: int) -> None:
        self.block_tokens = block_tokens
        self.high = vocab_size
        self._blocks: dict[int, list[int]] = {}

    def __call__(self, hash_id: int) -> list[int]:
        if hash_id not in self._blocks:
            generator = torch.Generator().manual_seed(0x5EED_0000 + int(hash_id))
            self._blocks[hash_id] = torch.randint(FIRST_PLAIN_ID, self.high, (self.block_tokens,),
                                                  generator=generator).tolist()
        return self._blocks[hash_id]


def scale_trace(records: list[dict[str, Any]], cfg: TraceBenchConfig, vocab_size: int) -> list[TraceRequest]:
    """Turn trace records into token prompts of the scaled lengths."""
    blocks = BlockTokens(cfg.block_tokens, vocab_size)
    requests = []
    for record in records:
        hash_ids = tuple(record["hash_ids"])
        length = max(1, math.ceil(record["input_length"] * cfg.block_tokens / TRACE_BLOCK_TOKENS))
        tokens = [t for h in hash_ids for t in blocks(h)][:length]
        out = max(1, min(int(record["output_length"]), cfg.max_output_tokens))
        requests.append(TraceRequest(hash_ids, tokens, out))
    return requests


def ideal_hit_tokens(requests: list[TraceRequest], block_tokens: int, interval: int | None = None) -> int:
    """Prompt tokens an unbounded cache could reuse, replaying in order: the longest prefix of
    hash ids seen before. With `interval`, hits are also cut to a multiple of it and to at most
    length - 1 (the engine resumes only at snapshot boundaries and computes >= 1 token)."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for request in requests:
        depth = 0
        while depth < len(request.hash_ids) and request.hash_ids[:depth + 1] in seen:
            depth += 1
        hit = min(depth * block_tokens, len(request.prompt))
        if interval is not None:
            hit = (min(hit, len(request.prompt) - 1) // interval) * interval
        total += hit
        seen.update(request.hash_ids[:i + 1] for i in range(len(request.hash_ids)))
    return total


class _Replay:
    """One engine's replay state: feeds requests in order, at most `max_concurrency` at a time,
    and adds up the time of its own steps (so two replays can be stepped alternately)."""

    def __init__(self, engine: LLMEngine, label: str, requests: list[TraceRequest], max_concurrency: int) -> None:
        self.engine = engine
        self.driver = EngineDriver(engine, label)
        self.requests = requests
        self.max_concurrency = max_concurrency
        self.pending = deque(range(len(requests)))
        self.index_of: dict[str, int] = {}
        self.outputs: list[RequestOutput | None] = [None] * len(requests)
        self.seconds = 0.0

    @property
    def done(self) -> bool:
        return not self.pending and not self.engine.has_unfinished_requests()

    def step(self) -> int:
        """Admit what the concurrency allows and run one engine step; returns requests finished."""
        start = time.perf_counter()
        engine = self.engine
        while self.pending and engine.num_running_requests + engine.num_waiting_requests < self.max_concurrency:
            index = self.pending.popleft()
            request_id = self.driver.next_id()
            self.index_of[request_id] = index
            request = self.requests[index]
            engine.add_request(request_id, request.prompt, greedy(request.output_tokens))
        finished = 0
        for output in engine.step():
            if output.finished:
                self.outputs[self.index_of[output.request_id]] = output
                finished += 1
        self.seconds += time.perf_counter() - start
        return finished


def _replay_alternating(replays: list[_Replay], progress: bool) -> None:
    """Step every unfinished replay in turn until all are done (cancels machine drift)."""
    total = sum(len(r.requests) for r in replays)
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
            "snapshots_evicted": stats["snapshots_evicted"]}


def run_trace_bench(engine_config: EngineConfig, cfg: TraceBenchConfig) -> dict[str, Any]:
    """Replay the scaled trace with the prefix cache on and off; returns figures and the output check."""
    on_config = engine_config if engine_config.cache.prefix_cache_enabled else with_prefix_cache(engine_config, 1024.0)
    on_engine, off_engine = LLMEngine(on_config), LLMEngine(with_prefix_cache(engine_config, 0))
    path = cfg.trace_path or str(default_trace_path())
    requests = scale_trace(read_trace(path, cfg.num_requests), cfg, on_engine.model_config.vocab_size)
    replays = {label: _Replay(engine, label, requests, cfg.max_concurrency)
               for label, engine in (("off", off_engine), ("on", on_engine))}
    _replay_alternating(list(replays.values()), cfg.progress)
    runs: dict[str, dict[str, Any]] = {}
    tokens: dict[str, list[list[int]]] = {}
    for label, replay in replays.items():
        replay.engine.check_integrity()
        outputs = [o for o in replay.outputs if o is not None]
        assert len(outputs) == len(requests)
        runs[label] = _run_summary(replay.seconds, outputs, replay.engine)
        tokens[label] = [o.outputs[0].token_ids for o in outputs]
    prompt_tokens = sum(len(r.prompt) for r in requests)
    interval = on_config.cache.snapshot_interval
    identical = sum(a == b for a, b in zip(tokens["on"], tokens["off"]))
    return {
        "config": asdict(cfg) | {"trace_path": path}, "engine": on_engine.describe(), "machine": machine_line(),
        "num_requests": len(requests), "prompt_tokens": prompt_tokens,
        "ideal_hit_share_blocks": ideal_hit_tokens(requests, cfg.block_tokens) / prompt_tokens,
        "ideal_hit_share_snapshots": ideal_hit_tokens(requests, cfg.block_tokens, interval) / prompt_tokens,
        "snapshot_interval": interval, "runs": runs, "identical_outputs": identical,
        "outputs_match": identical == len(requests),
        "mismatched_requests": [i for i, (a, b) in enumerate(zip(tokens["on"], tokens["off"])) if a != b],
    }


def format_trace_report(result: dict[str, Any]) -> str:
    """The result table printed by `bench trace`."""
    cfg, on, off = result["config"], result["runs"]["on"], result["runs"]["off"]
    rows = [[label, f"{run['hit_share']:.1%}", run["prefill_tokens_computed"], f"{run['seconds']:.1f}",
             run["preemptions"], run["snapshots_evicted"]] for label, run in (("off", off), ("on", on))]
    table = format_table(["cache", "hit share", "prefill tokens computed", "total s", "preemptions",
                          "snapshots evicted"], rows)
    return "\n".join([
        f"SCALED replay of the first {result['num_requests']} requests of {cfg['trace_path']}: each 512-token "
        f"hash block -> {cfg['block_tokens']} pseudo-random tokens, output capped at {cfg['max_output_tokens']} "
        f"tokens, max {cfg['max_concurrency']} concurrent, {result['prompt_tokens']} prompt tokens in all; "
        f"engines stepped alternately, time = sum of each engine's own steps",
        table,
        f"ideal hit share (unbounded cache, in order): {result['ideal_hit_share_blocks']:.1%} at block granularity, "
        f"{result['ideal_hit_share_snapshots']:.1%} at the engine's snapshot interval ({result['snapshot_interval']})",
        f"time on/off: {on['seconds'] / off['seconds']:.3f}; prefill tokens on/off: "
        f"{on['prefill_tokens_computed'] / max(off['prefill_tokens_computed'], 1):.3f}",
        f"greedy outputs identical with cache on and off: {result['identical_outputs']}/{result['num_requests']}"
        + ("" if result["outputs_match"] else f" (differ: requests {result['mismatched_requests'][:20]})"),
        f"engine (on): {result['engine']}\nmachine: {result['machine']}",
    ])


"""Helpers shared by the benchmarks: prompts, engine driving, timing statistics, tables, JSON.
Contenders run side by side in one process, alternating; warm-ups are discarded; medians.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from hybridserve.config import EngineConfig
from hybridserve.models.tokenizer import IM_END_ID
from hybridserve.sampling_params import RequestOutput, SamplingParams

if TYPE_CHECKING:  # torch loads with the benchmark that runs, not with the command line's flags
    import torch

    from hybridserve.engine.engine import LLMEngine

T = TypeVar("T")
FIRST_PLAIN_ID = IM_END_ID + 1  # ids below are bytes and specials; start random prompts after them
PLAIN_ID_SPAN = 256             # random prompts draw from [FIRST_PLAIN_ID, FIRST_PLAIN_ID + span)

# Client pools keep idle connections longer than uvicorn does, so a request sent on a pooled
# connection just as the server closes it fails; expiring them sooner leaves transport errors to
# the server's own faults.
KEEPALIVE_EXPIRY_S = 2.0


def random_token_ids(num_tokens: int, seed: int, vocab_size: int) -> list[int]:
    """`num_tokens` pseudo-random ordinary token ids, fixed by `seed` (no special tokens)."""
    import torch

    high = min(FIRST_PLAIN_ID + PLAIN_ID_SPAN, vocab_size)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_PLAIN_ID, high, (num_tokens,), generator=generator).tolist()


def median(values: Iterable[float]) -> float:
    """Median of the values (NaN when there are none)."""
    values = list(values)
    return statistics.median(values) if values else float("nan")


def cache_on_off(config: EngineConfig) -> tuple[EngineConfig, ...]:
    """(prefix cache on, off) variants of `config`; "on" keeps its pool and lower tiers, or gets 1 GiB
    if it had no pool; "off" has neither."""
    def pool(mib: float) -> EngineConfig:
        return dataclasses.replace(config, cache=dataclasses.replace(config.cache, prefix_cache_mib=mib))

    off = pool(0)
    off = dataclasses.replace(off, cache=dataclasses.replace(off.cache, host_cache_memory_bytes=0, disk_cache_dir=None,
                                                             remote_cache_url=None))
    return _split_default_gpu_share((config if config.cache.prefix_cache_enabled else pool(1024.0)), off)


def _split_default_gpu_share(*configs: EngineConfig) -> tuple[EngineConfig, ...]:
    """Engines that share one CUDA device in this process: each gets an equal part of the default
    memory fraction (each would otherwise plan for the whole device, and the second would not fit).
    Pool sizes, a fraction or a memory size the caller gave are kept; CPU engines are unchanged."""
    from hybridserve.engine.engine import resolve_device
    from hybridserve.engine.memory_plan import DEFAULT_CUDA_MEMORY_FRACTION

    def sized(cache: Any) -> bool:
        explicit_pools = cache.kv_cache_mib is not None and cache.prefix_cache_mib is not None
        return explicit_pools or cache.memory_fraction is not None or cache.kv_cache_memory_bytes is not None

    if any(resolve_device(c.device).type != "cuda" or sized(c.cache) for c in configs):
        return configs
    share = DEFAULT_CUDA_MEMORY_FRACTION / len(configs)
    return tuple(dataclasses.replace(c, cache=dataclasses.replace(c.cache, memory_fraction=share)) for c in configs)


def result_header(cfg: Any, engine: LLMEngine) -> dict[str, Any]:
    """The settings, the engine's sizes and the machine, which every result starts with."""
    return {"config": dataclasses.asdict(cfg), "engine": engine.describe(), "machine": machine_line()}


def finish(*engines: LLMEngine) -> None:
    """Check every engine's pool accounting, then stop its tensor-parallel workers."""
    for engine in engines:
        engine.check_integrity()
        engine.shutdown()


def alternate(items: Sequence[T], round_index: int) -> list[T]:
    """`items` in order in even rounds and reversed in odd ones, so that no contender always goes first."""
    return list(items) if round_index % 2 == 0 else list(reversed(items))


def measured_rounds(warmup: int, iterations: int, measure: Callable[[int], dict[str, list[Any]]]
                    ) -> dict[str, list[Any]]:
    """Call `measure(round)` `warmup + iterations` times; the samples of the measured rounds, by key."""
    samples: dict[str, list[Any]] = {}
    for round_index in range(warmup + iterations):
        values = measure(round_index)
        if round_index >= warmup:
            for key, value in values.items():
                samples.setdefault(key, []).extend(value)
    return samples


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy sampling of exactly `max_tokens` tokens (EOS ignored)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class RunResult(NamedTuple):
    """One request driven to completion alone: time to first token, per-step times after it."""

    ttft_s: float
    total_s: float
    decode_step_s: list[float]
    output: RequestOutput


class EngineDriver:
    """Drives an `LLMEngine` synchronously with unique request ids."""

    def __init__(self, engine: LLMEngine, tag: str) -> None:
        self.engine = engine
        self.tag = tag
        self._ids = itertools.count()

    def next_id(self) -> str:
        """A request id not used before by this driver."""
        return f"{self.tag}-{next(self._ids)}"

    def run(self, prompt: list[int], params: SamplingParams) -> RunResult:
        """Run one request alone; TTFT is measured from `add_request` to the first token."""
        engine = self.engine
        start = time.perf_counter()
        engine.add_request(self.next_id(), prompt, params)
        first: float | None = None
        steps: list[float] = []
        final: RequestOutput | None = None
        while engine.has_unfinished_requests():
            step_start = time.perf_counter()
            outputs = engine.step()
            now = time.perf_counter()
            if first is None and outputs:
                first = now
            elif outputs:
                steps.append(now - step_start)
            final = outputs[-1] if outputs else final
        assert final is not None and first is not None and final.finished
        return RunResult(first - start, time.perf_counter() - start, steps, final)

    def run_batch(self, prompts: Sequence[list[int]], params: SamplingParams) -> tuple[float, list[RequestOutput]]:
        """Queue all prompts at once and step until done; returns (wall seconds, outputs in order)."""
        engine = self.engine
        ids = [self.next_id() for _ in prompts]
        start = time.perf_counter()
        for request_id, prompt in zip(ids, prompts):
            engine.add_request(request_id, prompt, params)
        finished: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            for output in engine.step(final_only=True):
                finished[output.request_id] = output
        return time.perf_counter() - start, [finished[i] for i in ids]

    def decode_steps(self, prompts: Sequence[list[int]], num_tokens: int) -> tuple[list[float], list[RequestOutput]]:
        """Generate `num_tokens` greedy tokens for every prompt, all in one batch; returns the
        times of the steady-state steps (every request decoding, none prefilling) and the outputs.
        Like `LLM.generate`, outputs are built only for requests that finished."""
        engine = self.engine
        ids = [self.next_id() for _ in prompts]
        for request_id, prompt in zip(ids, prompts):
            engine.add_request(request_id, prompt, greedy(num_tokens))
        started: set[str] = set()
        steady: list[float] = []
        finished: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            all_started = len(started) == len(ids)
            step_start = time.perf_counter()
            groups = engine.step_groups()
            elapsed = time.perf_counter() - step_start
            if all_started and len(groups) == len(ids):
                steady.append(elapsed)
            for group in groups:
                started.add(group.request_id)
                if group.is_finished:
                    finished[group.request_id] = engine.output(group)
        return steady, [finished[i] for i in ids]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items `a` and `b` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def timed(work: Callable[[], object], device: torch.device) -> float:
    """Seconds `work()` takes, the device's queued work included (CUDA is synchronized around it)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def matmul_gflops(size: int, repeats: int, device: torch.device | str = "cpu",
                  dtype: torch.dtype | None = None) -> list[float]:
    """GFLOP/s of `repeats` square [size x size] matmuls on `device` in `dtype` (None: float32)."""
    import torch

    a, b = (torch.randn(size, size, device=device, dtype=dtype or torch.float32) for _ in range(2))
    torch.matmul(a, b)
    return [2 * size ** 3 / timed(lambda: torch.matmul(a, b), a.device) / 1e9 for _ in range(repeats)]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table (cells converted with `str`)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def goal_mark(met: bool | None) -> str:
    """'MET' / 'NOT MET' / '-' for a goal check."""
    return "-" if met is None else ("MET" if met else "NOT MET")


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    """Write `data` as indented JSON (creating parent directories)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2, default=str) + "\n")


def machine_line() -> str:
    """Torch threads and version, printed with every result."""
    import torch

    return f"torch {torch.__version__}, {torch.get_num_threads()} threads"

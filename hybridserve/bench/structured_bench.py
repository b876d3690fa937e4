"""`hybridserve bench structured`: decode cost of a JSON-schema constraint. Two identical engines
decode the same prompts with the same seeds, one under a schema, stepping alternately; each adjacent
pair of steady decode steps gives a ratio.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from hybridserve.bench import common
from hybridserve.bench.configs import StructuredBenchConfig
from hybridserve.config import EngineConfig
from hybridserve.engine import sampling
from hybridserve.engine.engine import LLMEngine
from hybridserve.sampling_params import SamplingParams, StructuredOutputsParams

GOAL_RATIO = 1.15
EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 80},
        "priority": {"type": "string", "enum": ["low", "medium", "high"]},
        "attendees": {"type": "array", "maxItems": 8, "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
                           "confirmed": {"type": "boolean"}},
            "required": ["name", "age", "confirmed"], "additionalProperties": False}},
        "notes": {"type": "string", "maxLength": 400},
    },
    "required": ["title", "priority", "attendees", "notes"],
    "additionalProperties": False,
}


def _params(constrained: bool, cfg: StructuredBenchConfig) -> SamplingParams:
    """Same sampling in both modes; the constrained one carries the schema."""
    structured = StructuredOutputsParams(json=EVENT_SCHEMA) if constrained else None
    return SamplingParams(max_tokens=cfg.decode_tokens, temperature=1.0, seed=cfg.seed, ignore_eos=True,
                          structured_outputs=structured)


class _Run:
    """One engine decoding one batch; `step()` records the time of steady decode steps."""

    def __init__(self, driver: common.EngineDriver, prompts: list[list[int]], params: SamplingParams) -> None:
        self.engine = driver.engine
        self.ids = [driver.next_id() for _ in prompts]
        for request_id, prompt in zip(self.ids, prompts):
            self.engine.add_request(request_id, prompt, params)
        self.started: set[str] = set()

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()

    def step(self) -> float | None:
        """One engine step; its seconds when every request decoded in it (none finished)."""
        all_started = len(self.started) == len(self.ids)
        begin = time.perf_counter()
        outputs = self.engine.step()
        elapsed = time.perf_counter() - begin
        self.started.update(o.request_id for o in outputs)
        steady = all_started and len(outputs) == len(self.ids) and not any(o.finished for o in outputs)
        return elapsed if steady else None


def _paired_steps(drivers: tuple[common.EngineDriver, common.EngineDriver], prompts: list[list[int]],
                  cfg: StructuredBenchConfig, mask_spent: list[float]) -> list[tuple[float, float, float]]:
    """Alternate steps of the unconstrained and the constrained run; (free, constrained, mask) seconds
    of adjacent steady steps, mask being what the constrained step spent in `mask_spent`'s calls."""
    free, constrained = _Run(drivers[0], prompts, _params(False, cfg)), _Run(drivers[1], prompts, _params(True, cfg))
    steps = []
    while not (free.done and constrained.done):
        a = free.step() if not free.done else None
        masked_before = mask_spent[0]
        b = constrained.step() if not constrained.done else None
        if a is not None and b is not None:
            steps.append((a, b, mask_spent[0] - masked_before))
    return steps


@contextlib.contextmanager
def _mask_clock(engine: LLMEngine) -> Iterator[list[float]]:
    """While open, `engine`'s seconds in the calls that mask a constrained draw (`TokenMasker.bitmask`
    in the engine, `apply_bitmask` in sampling), summed into a one-item list. Only calls made in this
    process count: with tensor parallelism the workers' `apply_bitmask` is left out."""
    spent = [0.0]

    def clocked(function: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            begin = time.perf_counter()
            try:
                return function(*args)
            finally:
                spent[0] += time.perf_counter() - begin

        return call

    masker = engine._masker  # noqa: SLF001 - benchmark instrumentation
    assert masker is not None
    original_apply = getattr(sampling, "apply_bitmask")  # imported there from structured_output
    setattr(masker, "bitmask", clocked(masker.bitmask))  # timing wrappers with the same arguments
    setattr(sampling, "apply_bitmask", clocked(original_apply))
    try:
        yield spent
    finally:
        setattr(sampling, "apply_bitmask", original_apply)
        delattr(masker, "bitmask")


def run_structured_bench(engine_config: EngineConfig, cfg: StructuredBenchConfig) -> dict[str, Any]:
    """Measure both modes at every batch size; returns the figures as a dict."""
    engines = (LLMEngine(engine_config), LLMEngine(engine_config))
    drivers = (common.EngineDriver(engines[0], "free"), common.EngineDriver(engines[1], "json"))
    vocab = engines[0].model_config.vocab_size
    first_compile_s = common.timed(lambda: engines[1].grammars.matcher(StructuredOutputsParams(json=EVENT_SCHEMA)),
                                   engines[1].device)
    rows = []
    with _mask_clock(engines[1]) as mask_spent:
        for batch in cfg.batch_sizes:
            prompts = [common.random_token_ids(cfg.prompt_tokens, cfg.seed * 1009 + batch * 31 + j, vocab)
                       for j in range(batch)]
            samples = common.measured_rounds(cfg.warmup, cfg.iterations,
                                             lambda _: {"steps": _paired_steps(drivers, prompts, cfg, mask_spent)})
            steps = samples.get("steps", [])
            free, constrained = common.median(a for a, _, _ in steps), common.median(b for _, b, _ in steps)
            ratio = common.median(b / a for a, b, _ in steps)
            rows.append({"batch": batch, "unconstrained_step_ms": 1000 * free,
                         "json_schema_step_ms": 1000 * constrained, "ratio": ratio,
                         "mask_ms": 1000 * common.median(mask for _, _, mask in steps), "pairs_measured": len(steps),
                         "goal_met": ratio <= GOAL_RATIO})
    common.finish(*engines)
    compile_cache = engines[1].grammars.cache_info()._asdict()
    return common.result_header(cfg, engines[0]) | {"first_compile_ms": 1000 * first_compile_s,
                                                    "compile_cache": compile_cache, "rows": rows}


def format_structured_report(result: dict[str, Any]) -> str:
    """The figures as a text table."""
    table = common.format_table(
        ["batch", "unconstrained ms/step", "JSON schema ms/step", "paired ratio (median)", "mask ms/step",
         "pairs", f"goal <= {GOAL_RATIO}x"],
        [[r["batch"], f"{r['unconstrained_step_ms']:.2f}", f"{r['json_schema_step_ms']:.2f}", f"{r['ratio']:.3f}",
          f"{r['mask_ms']:.3f}", r["pairs_measured"], common.goal_mark(r["goal_met"])] for r in result["rows"]])
    cache = result["compile_cache"]
    return (f"{table}\n\nschema compiled once in {result['first_compile_ms']:.1f} ms; compile cache: "
            f"{cache['misses']} miss(es), {cache['hits']} hit(s)\n{result['engine']}\n{result['machine']}")

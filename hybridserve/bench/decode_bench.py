"""`bench decode`: batch-1 decode against the memory-bandwidth floor, and what lower precision costs.
One engine per weight format; speed next to the time to read its weight bytes once and the time of
its linears alone; quality against float32 (logit errors, top-1 and greedy agreement).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from hybridserve.bench import common
from hybridserve.bench.configs import DecodeBenchConfig
from hybridserve.config import EngineConfig
from hybridserve.engine.engine import LLMEngine
from hybridserve.layers.huge_pages import huge_page_buffer, huge_pages_available
from hybridserve.layers.linear import PackedLinear

VARIANTS = {"float32": ("float32", None), "bfloat16": ("bfloat16", None), "int8": ("float32", "int8")}


def variant_config(base: EngineConfig, variant: str) -> EngineConfig:
    """`base` in one of the benchmark's weight formats (ValueError for an unknown one)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    dtype, quantization = VARIANTS[variant]
    return dataclasses.replace(base, dtype=dtype, quantization=quantization)


def _median_seconds(work: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of `work()` over `repeats` runs after one discarded run."""
    return common.median([common.timed(work, device) for _ in range(repeats + 1)][1:])


def weight_read_seconds(num_bytes: int, device: torch.device | str = "cpu", repeats: int = 7) -> float:
    """Median seconds to read `num_bytes` once on `device` with a torch reduction (the decode floor).
    On CPU the buffer sits in huge pages, where the engine's weights do."""
    count = max(1, num_bytes // 4)
    if torch.device(device).type == "cpu" and huge_pages_available():
        buffer = huge_page_buffer(4 * count).view(torch.float32).fill_(1.0)
    else:
        buffer = torch.ones(count, dtype=torch.float32, device=device)
    return _median_seconds(buffer.sum, buffer.device, repeats)


def linears_seconds(engine: LLMEngine, repeats: int = 7) -> float:
    """Median seconds of one pass of every packed linear of the model (LM head included) on a
    single row, back to back: the decode step's GEMV work with no other op around it."""
    model = engine.runner.model
    linears = [v for m in model.modules() for v in vars(m).values() if isinstance(v, PackedLinear)]
    inputs = [torch.zeros(1, lin.weight.shape[1], dtype=engine.dtype, device=engine.device) for lin in linears]

    def run_all() -> None:
        for lin, x in zip(linears, inputs):
            lin(x)

    with torch.inference_mode():
        return _median_seconds(run_all, engine.device, repeats)


def measure_speed(engines: dict[str, LLMEngine], cfg: DecodeBenchConfig) -> dict[str, dict[str, float]]:
    """Alternating rounds over the engines: decode ms/token and the floor of each."""
    vocab = next(iter(engines.values())).model_config.vocab_size
    drivers = {name: common.EngineDriver(engine, f"decode-{name}") for name, engine in engines.items()}

    def one_round(round_index: int) -> dict[str, list[float]]:
        prompt = common.random_token_ids(cfg.prompt_tokens, cfg.seed + round_index, vocab)
        samples = {}
        for name, engine in engines.items():
            steps = drivers[name].run(prompt, common.greedy(cfg.decode_tokens)).decode_step_s
            samples[f"{name} decode"] = [1000 * common.median(steps)]
            samples[f"{name} read"] = [1000 * weight_read_seconds(engine.weight_bytes, engine.device)]
            samples[f"{name} linears"] = [1000 * linears_seconds(engine)]
        return samples

    samples = common.measured_rounds(cfg.warmup, cfg.iterations, one_round)
    result = {}
    for name, engine in engines.items():
        ms, read, linears = (common.median(samples[f"{name} {kind}"]) for kind in ("decode", "read", "linears"))
        result[name] = {"decode_ms_per_token": ms, "weight_read_ms": read, "weight_mib": engine.weight_bytes / 2**20,
                        "linears_ms": linears, "decode_over_floor": ms / read, "linears_over_floor": linears / read}
    return result


def measure_quality(reference: LLMEngine, engine: LLMEngine, cfg: DecodeBenchConfig) -> dict[str, float]:
    """Logit error, top-1 and greedy agreement of `engine` against the float32 `reference`."""
    vocab = reference.model_config.vocab_size
    max_err, abs_err, positions, top1, margins = 0.0, 0.0, 0, 0, []
    agreed_prefix, exact = [], 0
    for index in range(cfg.quality_prompts):
        prompt = common.random_token_ids(cfg.quality_prompt_tokens, 1000 + cfg.seed + index, vocab)
        salt = f"quality-{index}-{time.monotonic_ns()}"  # no prefix hit: every position is computed
        ref_logits, logits = reference.prompt_logits(prompt, salt), engine.prompt_logits(prompt, salt)
        diff = (logits - ref_logits).abs()
        max_err = max(max_err, float(diff.max()))
        abs_err += float(diff.mean()) * diff.shape[0]
        positions += diff.shape[0]
        top1 += int((logits.argmax(-1) == ref_logits.argmax(-1)).sum())
        best_two = ref_logits.topk(2, dim=-1).values
        margins.extend((best_two[:, 0] - best_two[:, 1]).tolist())
        ref_ids = _greedy_ids(reference, prompt, cfg.greedy_tokens)
        ids = _greedy_ids(engine, prompt, cfg.greedy_tokens)
        agreed_prefix.append(common.common_prefix_length(ref_ids, ids))
        exact += ids == ref_ids
    return {"max_abs_logit_error": max_err, "mean_abs_logit_error": abs_err / positions,
            "top1_agreement": top1 / positions, "float32_top1_margin_median": common.median(margins),
            "greedy_agreed_tokens_median": common.median(agreed_prefix),
            "greedy_exact": exact, "greedy_sequences": cfg.quality_prompts}


def _greedy_ids(engine: LLMEngine, prompt: list[int], num_tokens: int) -> list[int]:
    driver = common.EngineDriver(engine, f"greedy-{id(engine)}-{time.monotonic_ns()}")
    return list(driver.run(prompt, common.greedy(num_tokens)).output.outputs[0].token_ids)


def run_decode_bench(base: EngineConfig, cfg: DecodeBenchConfig) -> dict[str, Any]:
    """Build one engine per variant, measure speed side by side, then quality against float32."""
    engines = {name: LLMEngine(variant_config(base, name)) for name in cfg.variants}
    speed = measure_speed(engines, cfg)
    reference = engines.get("float32")
    quality = {name: measure_quality(reference, engine, cfg) for name, engine in engines.items()
               if reference is not None and name != "float32"}
    return {"machine": common.machine_line(), "config": asdict(cfg), "speed": speed, "quality": quality}


def format_decode_report(result: dict[str, Any]) -> str:
    """Speed table (ms/token vs floor) and quality table (against float32)."""
    speed_rows = [[name, f"{s['weight_mib']:.1f}", f"{s['weight_read_ms']:.2f}", f"{s['linears_ms']:.2f}",
                   f"{s['decode_ms_per_token']:.2f}", f"{s['linears_over_floor']:.2f}x",
                   f"{s['decode_over_floor']:.2f}x"] for name, s in result["speed"].items()]
    lines = [result["machine"], "batch-1 decode (offline engine), medians of alternating rounds:",
             common.format_table(["weights", "MiB", "read once ms", "linears ms", "decode ms/token", "linears / read",
                                  "decode / read"], speed_rows)]
    if result["quality"]:
        quality_rows = [[name, f"{q['max_abs_logit_error']:.4f}", f"{q['mean_abs_logit_error']:.5f}",
                         f"{100 * q['top1_agreement']:.2f}%", f"{q['float32_top1_margin_median']:.4f}",
                         f"{q['greedy_agreed_tokens_median']:.0f}",
                         f"{q['greedy_exact']}/{q['greedy_sequences']}"] for name, q in result["quality"].items()]
        lines += ["", "against float32 (prompt logits at every position; greedy continuations):",
                  common.format_table(["weights", "max |dlogit|", "mean |dlogit|", "top-1 agree", "f32 top-1 margin",
                                       "greedy tokens agreed", "greedy exact"], quality_rows)]
    return "\n".join(lines)

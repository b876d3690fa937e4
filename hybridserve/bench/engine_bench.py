"""`hybridserve bench engine`: hybridserve vs transformers on the same weights, in one process:
(a) cold prefill TTFT against one transformers forward, (b) batch-1 decode ms/token, (c) decode
tokens/s at batch B over batch 1, (d) prefill FLOP rate against the device's matmul rate.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

import torch

from hybridserve.bench import common
from hybridserve.bench.configs import EngineBenchConfig
from hybridserve.config import LINEAR_ATTENTION, EngineConfig, ModelConfig
from hybridserve.engine.engine import GDN_CHUNK_SIZE, LLMEngine
from hybridserve.models.builtin import parameter_shapes, save_builtin_checkpoint

PREFILL_SPEEDUP_GOAL = 1.5   # hybridserve prefill at least 1.5x faster than transformers
DECODE_RATIO_GOAL = 1 / 3    # hybridserve ms/token at most 1/3 of transformers'
BATCH_SPEEDUP_GOAL = 8.0     # batch-16 aggregate tokens/s at least 8x batch 1


def prefill_flops(config: ModelConfig, num_tokens: int, gdn_chunk: int) -> dict[str, float]:
    """Estimated FLOPs of one prefill of `num_tokens` tokens producing the last token's logits.

    matmul:    2 * P * T, P = weights of every linear layer (embedding lookup and conv excluded)
    lm_head:   2 * V * h (one position)
    attention: per full-attention layer 2 * H * d * T * (T + 1) (QK^T and PV, causal half)
    gdn:       per GDN layer, per value head and chunk of C tokens (T padded to whole chunks):
               4 C^2 Dk (K_beta K^T, Q K^T) + C^2 (Dk + Dv) (triangular solve) + 2 C^2 Dv (intra P V)
               + 6 C Dk Dv (three products with the [Dk, Dv] state), plus the conv 2 * K * conv_dim * T.
    Elementwise work (norms, gates, activations, decays) is not counted.
    """
    t, shapes = num_tokens, parameter_shapes(config)
    linear = sum(s[0] * s[1] for name, s in shapes.items()
                 if len(s) == 2 and name.startswith("model.layers."))
    num_attention = len(config.attention_layer_ids)
    attention = num_attention * 2.0 * config.num_attention_heads * config.head_dim * t * (t + 1)
    c, dk, dv = gdn_chunk, config.linear_key_head_dim, config.linear_value_head_dim
    per_chunk = 4 * c * c * dk + c * c * (dk + dv) + 2 * c * c * dv + 6 * c * dk * dv
    chunks = -(-t // c)
    num_gdn = sum(1 for kind in config.layer_types if kind == LINEAR_ATTENTION)
    gdn = num_gdn * (config.linear_num_value_heads * chunks * per_chunk
                     + 2 * config.linear_conv_kernel_dim * config.gdn_conv_dim * t)
    parts = {"matmul": 2.0 * linear * t, "lm_head": 2.0 * config.vocab_size * config.hidden_size,
             "attention": attention, "gdn": float(gdn)}
    parts["total"] = sum(parts.values())
    return parts


def load_reference_model(engine: LLMEngine) -> torch.nn.Module:
    """transformers' `Qwen3_5ForCausalLM` with the engine's weights (its checkpoint, or the built-in
    weights of its seed) on its device in its dtype, eval mode, quiet."""
    from transformers import Qwen3_5ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # transformers declares no types here
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    with tempfile.TemporaryDirectory(prefix="hybridserve-bench-") as tmp:
        model_dir = engine.config.model or save_builtin_checkpoint(tmp, seed=engine.config.seed)
        model: torch.nn.Module = Qwen3_5ForCausalLM.from_pretrained(str(model_dir), dtype=engine.dtype)
    return model.to(engine.device).eval()


@torch.inference_mode()
def reference_prefill_s(model: torch.nn.Module, ids: list[int]) -> float:
    """Seconds for one transformers forward over `ids` (last logits only, no cache)."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    return common.timed(lambda: model(input_ids=x, use_cache=False, logits_to_keep=1), device)


@torch.inference_mode()
def reference_decode(model: torch.nn.Module, ids: list[int], num_tokens: int) -> tuple[list[float], list[int]]:
    """Greedy decode with transformers' own cache; per-step seconds after the prefill, and tokens."""
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1)
    token = out.logits[0, -1].argmax()
    tokens, steps = [int(token)], []
    # the cache object is updated in place; newer transformers name it `cache`, older ones `past_key_values`
    cache_kw = "cache" if hasattr(out, "cache") else "past_key_values"
    cache = {cache_kw: getattr(out, cache_kw)}
    for _ in range(num_tokens - 1):
        start = time.perf_counter()
        token = model(input_ids=token.view(1, 1), **cache, use_cache=True).logits[0, -1].argmax()
        tokens.append(int(token))
        steps.append(time.perf_counter() - start)
    return steps, tokens


def run_engine_bench(engine_config: EngineConfig, cfg: EngineBenchConfig) -> dict[str, Any]:
    """Run (a)-(d) and return the figures (medians, ratios, goal checks) as a dict."""
    engine = LLMEngine(engine_config)
    driver = common.EngineDriver(engine, "bench")
    vocab = engine.model_config.vocab_size
    model = load_reference_model(engine)

    def prefill_round(i: int) -> dict[str, list[float]]:
        ids = common.random_token_ids(cfg.prompt_tokens, cfg.seed * 7919 + i, vocab)  # fresh: never cached
        contenders = {"hybridserve_s": lambda: driver.run(ids, common.greedy(1)).ttft_s,
                      "transformers_s": lambda: reference_prefill_s(model, ids)}
        times = {name: [contenders[name]()] for name in common.alternate(list(contenders), i)}
        rates = common.matmul_gflops(cfg.matmul_size, cfg.matmul_repeats, engine.device, engine.dtype)
        return {name: times[name] for name in contenders} | {"matmul_gflops": rates}

    def decode_round(i: int) -> dict[str, list[float]]:
        base = 1_000_003 + (cfg.seed * 101 + i) * cfg.batch_size
        prompts = [common.random_token_ids(cfg.decode_prompt_tokens, base + j, vocab) for j in range(cfg.batch_size)]
        hs_b1, hs_out = driver.decode_steps(prompts[:1], cfg.decode_tokens)
        hf_b1, hf_tokens = reference_decode(model, prompts[0], cfg.decode_tokens)
        return {"hybridserve_b1_s": hs_b1, "transformers_b1_s": hf_b1,
                "hybridserve_batch_s": driver.decode_steps(prompts, cfg.decode_tokens)[0],
                "greedy_match": [common.common_prefix_length(hs_out[0].outputs[0].token_ids, hf_tokens)]}

    prefill = common.measured_rounds(cfg.warmup, cfg.iterations, prefill_round)
    decode = common.measured_rounds(cfg.warmup, cfg.iterations, decode_round)
    common.finish(engine)
    return _summarize(engine, cfg, prefill, decode)


def _summarize(engine: LLMEngine, cfg: EngineBenchConfig, prefill: dict[str, list[float]],
               decode: dict[str, Any]) -> dict[str, Any]:
    hs_prefill, hf_prefill = common.median(prefill["hybridserve_s"]), common.median(prefill["transformers_s"])
    hs_tok, hf_tok = common.median(decode["hybridserve_b1_s"]), common.median(decode["transformers_b1_s"])
    batch_step = common.median(decode["hybridserve_batch_s"])
    flops = prefill_flops(engine.model_config, cfg.prompt_tokens, GDN_CHUNK_SIZE)
    matmul = common.median(prefill["matmul_gflops"])
    model_gflops = flops["total"] / hs_prefill / 1e9
    b1_tps, batch_tps = 1.0 / hs_tok, cfg.batch_size / batch_step
    return common.result_header(cfg, engine) | {
        "prefill": {"hybridserve_ttft_s": hs_prefill, "transformers_forward_s": hf_prefill,
                    "speedup": hf_prefill / hs_prefill, "goal": PREFILL_SPEEDUP_GOAL,
                    "met": hf_prefill / hs_prefill >= PREFILL_SPEEDUP_GOAL, "samples": prefill},
        "decode_b1": {"hybridserve_ms_per_token": 1e3 * hs_tok, "transformers_ms_per_token": 1e3 * hf_tok,
                      "ratio": hs_tok / hf_tok, "goal": DECODE_RATIO_GOAL, "met": hs_tok / hf_tok <= DECODE_RATIO_GOAL,
                      "greedy_tokens_matching": decode["greedy_match"], "tokens": cfg.decode_tokens},
        "decode_batch": {"batch_size": cfg.batch_size, "batch_tokens_per_s": batch_tps, "b1_tokens_per_s": b1_tps,
                         "speedup": batch_tps / b1_tps, "goal": BATCH_SPEEDUP_GOAL,
                         "met": batch_tps / b1_tps >= BATCH_SPEEDUP_GOAL},
        "flops": {"prefill_flops": flops, "model_gflops": model_gflops, "matmul_gflops": matmul,
                  "fraction_of_matmul": model_gflops / matmul},
    }


def format_engine_report(result: dict[str, Any]) -> str:
    """The result table printed by `bench engine`."""
    cfg, p, d, b, f = (result[k] for k in ("config", "prefill", "decode_b1", "decode_batch", "flops"))
    rows = [
        [f"(a) cold prefill, {cfg['prompt_tokens']} tokens (s)", f"{p['hybridserve_ttft_s']:.2f}",
         f"{p['transformers_forward_s']:.2f}", f"{p['speedup']:.2f}x faster", f">= {p['goal']}x",
         common.goal_mark(p["met"])],
        ["(b) decode batch 1 (ms/token)", f"{d['hybridserve_ms_per_token']:.1f}",
         f"{d['transformers_ms_per_token']:.1f}", f"{d['ratio']:.2f}", f"<= {d['goal']:.2f}",
         common.goal_mark(d["met"])],
        [f"(c) decode batch {b['batch_size']} vs 1 (tokens/s)", f"{b['batch_tokens_per_s']:.0f} vs "
         f"{b['b1_tokens_per_s']:.0f}", "-", f"{b['speedup']:.2f}x", f">= {b['goal']}x", common.goal_mark(b["met"])],
        ["(d) prefill model GFLOP/s / matmul GFLOP/s", f"{f['model_gflops']:.1f} / {f['matmul_gflops']:.1f}", "-",
         f"{100 * f['fraction_of_matmul']:.0f}%", "-", common.goal_mark(None)],
    ]
    table = common.format_table(["measure", "hybridserve", "transformers", "ratio", "goal", "status"], rows)
    flops = f["prefill_flops"]
    notes = (f"engine: {result['engine']}\nmachine: {result['machine']}; medians of {cfg['iterations']} iterations "
             f"after {cfg['warmup']} warm-up(s), contenders alternated\n"
             f"prefill GFLOP estimate: matmul {flops['matmul'] / 1e9:.1f} + attention {flops['attention'] / 1e9:.1f} "
             f"+ gdn {flops['gdn'] / 1e9:.1f} + lm_head {flops['lm_head'] / 1e9:.3f} = {flops['total'] / 1e9:.1f}\n"
             f"greedy tokens equal to transformers (of {d['tokens']}), per iteration: {d['greedy_tokens_matching']}")
    return table + "\n" + notes

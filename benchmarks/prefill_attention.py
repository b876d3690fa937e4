"""`python -m benchmarks.prefill_attention`: a prompt chunk's attention over the paged KV, C against torch.

For each shape (query tokens behind a prefix of cached tokens; heads as the flags say, by default
the built-in model's: 8 query heads over 2 KV heads of 64), the keys and values sit at scattered
slots of one layer of a paged cache. Two ways to attend, timed side by side (median of `--repeats`
after two warm-ups each):

- torch: gather the sequence's keys and values (`index_select`), then SDPA with `enable_gqa` (the
  lower-right causal mask behind a prefix, `is_causal` without one) — the path without the kernels;
- c: `native.prefill_attention`, reading the cache in place (`csrc/prefill_attention.c`).

Prints one JSON object: per shape the two medians in ms, c/torch, and the largest difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from hybridserve.layers import native
from hybridserve.layers.attention import prefill_attention

SHAPES = ((64, 4096), (520, 520), (1100, 1000), (600, 3000), (1500, 200), (2000, 2000), (700, 0), (2100, 0),
          (4000, 0))  # (query tokens, prefix tokens)


def _median_ms(run: Callable[[], object], repeats: int) -> float:
    for _ in range(2):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def measure(tokens: int, prefix: int, repeats: int, gen: torch.Generator, heads: int = 8, kv_heads: int = 2,
            head_dim: int = 64) -> dict[str, float]:
    """Both paths on one shape: medians (ms), their ratio and the largest output difference."""
    num_slots = 2 * (prefix + tokens) + 64
    cache_keys = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    cache_values = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    slots = torch.randperm(num_slots, generator=gen)[:prefix + tokens].contiguous()
    q = torch.randn(tokens, heads, head_dim, generator=gen)
    scale = head_dim ** -0.5

    def with_torch() -> torch.Tensor:
        keys, values = cache_keys.index_select(0, slots), cache_values.index_select(0, slots)
        return prefill_attention(q, keys, values, prefix, scale)

    def with_c() -> torch.Tensor:
        return native.prefill_attention(q, cache_keys, cache_values, slots, scale)

    difference = float((with_c() - with_torch()).abs().max())
    torch_ms, c_ms = _median_ms(with_torch, repeats), _median_ms(with_c, repeats)
    return {"torch_ms": round(torch_ms, 3), "c_ms": round(c_ms, 3), "c/torch": round(c_ms / torch_ms, 3),
            "max_abs_difference": difference}


def main(argv: list[str] | None = None) -> int:
    """Time every shape and print the figures as JSON (exit 1 where the C kernel is not built)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefill_attention", description=__doc__)
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per path and shape")
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="KV heads")
    parser.add_argument("--head-dim", type=int, default=64, help="head size (a multiple of 64 up to 256)")
    args = parser.parse_args(argv)
    q = torch.empty(1, args.heads, args.head_dim)
    if not native.prefill_attention_applies(q, torch.empty(1, args.kv_heads, args.head_dim),
                                            torch.zeros(1, dtype=torch.long)):
        print(json.dumps({"error": "csrc/prefill_attention.c is not available here (it needs AVX-512)"}))
        return 1
    gen = torch.Generator().manual_seed(0)
    result = {"threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "heads": [args.heads, args.kv_heads, args.head_dim],
              "shapes": {f"{tokens} behind {prefix}": measure(tokens, prefix, args.repeats, gen, args.heads,
                                                              args.kv_heads, args.head_dim)
                         for tokens, prefix in SHAPES}}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m benchmarks.tier_ttft`: TTFT of a long prompt whose prefix is restored from each cache tier.

The built-in model (or `--model`) on the CPU in float32 (or `--device cuda`, bfloat16), greedy,
`max_tokens=1`; device pools sized from the model so that two filler prompts push a prefix out.
TTFT here is the wall time of one `LLM.generate` call for a prompt of a shared prefix
(`--prefix-tokens`) plus fresh tokens (`--fresh-tokens`). Each sample draws a new random prefix
and measures it five ways, in an order that rotates per round.

The warm engines use the `interval` cache policy with one snapshot per prefix length, so the
snapshot a prompt leaves is exactly the shared prefix's (the default policy would first need a
second request to mark the branch point). Modes:

- cold: an engine with the prefix cache off;
- device: the prefix was just served by the same engine, so its KV and snapshot are on the device;
- host: as device, then filler prompts push the prefix's snapshot and KV out of a small device pool,
  so the timed request restores them from the host tier (host memory);
- disk: the same with the host tier off and a disk tier on;
- restart: one engine writes the prefix through to a disk directory and shuts down; a new engine on
  that directory serves one short unrelated request, then the timed one (construction not timed).

Each warm mode checks the restored token count and, for host/disk/restart, that the hit was counted
by that tier (`LLM.tier_stats()`). The first round is a warm-up; the report gives medians, the goal
ratios host/device, disk/device and restart/cold, and whether the outputs (token and logprobs) are
identical across the five modes (to rounding: float32's, or bfloat16's on a GPU). The host and disk
engines use `--tier-write-policy` (default: the server's, write-through; with write-back the timed
request's own admission also copies out the filler it evicts).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybridserve.config import TIER_WRITE_POLICIES

MODES = ("cold", "device", "host", "disk", "restart")
FILLERS = 2  # prompts as long as the timed one: enough to push the prefix out of the small device pools
HOST_POOLS = 16  # host and disk tiers: this many times the device pools (room for every round's prefix)
MIB = 1 << 20
PROFILE_ROWS = 40  # functions listed per ordering in --profile's file
# Restored and recomputed logprobs agree to rounding: float32's, or bfloat16's (a few layers of bf16
# GEMMs over a different chunking of the prompt) on a GPU.
LOGPROB_ATOL = {"float32": 1e-4, "bfloat16": 1e-1, "float16": 1e-2}


def _tokens(length: int, seed: int) -> list[int]:
    return torch.randint(0, 4000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _wait_for_tiers(llm: Any) -> None:
    """Let the engine's tier mover finish its queued demotions, so none is in flight when timing."""
    mover = llm.llm_engine.tier_mover
    while mover is not None and mover.busy:
        mover.wait(0.05)


def _tier_hits(llm: Any, name: str) -> int:
    return sum(stats.hits for stats in llm.tier_stats() if stats.name == name)


class TierBench:
    """The engines and the per-mode measurement of one sample."""

    def __init__(self, prefix_tokens: int, fresh_tokens: int, kv_cache_mib: float | None,
                 prefix_cache_mib: float | None, snapshot_interval: int, workdir: Path, device: str = "cpu",
                 dtype: str = "float32", model: str | None = None, write_policy: str = "write-through") -> None:
        from hybridserve import LLM, SamplingParams

        self.llm_class = LLM
        self.params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=2)
        self.prefix_tokens, self.fresh_tokens = prefix_tokens, fresh_tokens
        common: dict[str, Any] = {"device": device, "dtype": dtype, "max_model_len": prefix_tokens + fresh_tokens + 16}
        if model is not None:
            common["model"] = model
        kv_mib, snapshot_mib = self._device_pools(model, dtype, kv_cache_mib, prefix_cache_mib)
        self.pools: dict[str, Any] = {**common, "kv_cache_mib": kv_mib, "prefix_cache_mib": snapshot_mib,
                                      "snapshot_interval": snapshot_interval, "cache_policy": "interval"}
        self.lower_tier_size = f"{HOST_POOLS * (kv_mib + snapshot_mib):.0f}MiB"
        self.workdir = workdir
        self.engines = {
            "cold": LLM(**common, kv_cache_mib=kv_mib, prefix_cache_mib=0),
            "device": LLM(**self.pools),
            "host": LLM(**self.pools, host_cache_memory=self.lower_tier_size, tier_write_policy=write_policy),
            "disk": LLM(**self.pools, disk_cache_dir=self._private_dir("disk"), disk_cache_size=self.lower_tier_size,
                        tier_write_policy=write_policy),
        }

    def _device_pools(self, model: str | None, dtype: str, kv_cache_mib: float | None,
                      prefix_cache_mib: float | None) -> tuple[float, float]:
        """Device pools small enough that FILLERS prompts push the prefix out: KV for just under two
        prompts, two and a half snapshots (two slots); an explicit size wins."""
        from hybridserve.cache.state_tensors import GDNStateTensors
        from hybridserve.config import CacheConfig
        from hybridserve.layers.attention import PagedKVCache
        from hybridserve.models.builtin import BUILTIN_MODEL_CONFIG
        from hybridserve.models.loader import read_model_config, resolve_model

        config = BUILTIN_MODEL_CONFIG if model is None else read_model_config(resolve_model(model))
        torch_dtype, block_size = getattr(torch, dtype), CacheConfig().block_size
        block_bytes = block_size * PagedKVCache.bytes_per_token(
            len(config.attention_layer_ids), config.num_key_value_heads, config.head_dim, torch_dtype)
        prompt_blocks = -(-(self.prefix_tokens + self.fresh_tokens) // block_size)
        kv = kv_cache_mib or (2 * prompt_blocks - 8) * block_bytes / MIB
        return kv, prefix_cache_mib or 2.5 * GDNStateTensors.bytes_per_slot(config, torch_dtype) / MIB

    def _private_dir(self, name: str) -> str:
        path = self.workdir / name
        path.mkdir(mode=0o700)
        return str(path)

    def _timed(self, llm: Any, prompt: list[int]) -> tuple[float, Any]:
        start = time.perf_counter()
        out = llm.generate([prompt], self.params, use_tqdm=False)[0]
        return time.perf_counter() - start, out

    def _populate(self, llm: Any, prefix: list[int], seed: int, evict: bool) -> None:
        """Serve the prefix once (another fresh tail); with `evict`, then push it off the device."""
        llm.generate([prefix + _tokens(self.fresh_tokens, seed + 1)], self.params, use_tqdm=False)
        if evict:
            for filler in range(FILLERS):
                llm.generate([_tokens(self.prefix_tokens + self.fresh_tokens, seed + 10 + filler)], self.params,
                             use_tqdm=False)
        _wait_for_tiers(llm)

    def measure(self, mode: str, seed: int) -> dict[str, Any]:
        """One timed request in `mode` for sample `seed`: seconds, restored tokens, the tier hit, output."""
        prefix = _tokens(self.prefix_tokens, seed)
        prompt = prefix + _tokens(self.fresh_tokens, seed + 2)
        if mode == "restart":
            return self._measure_restart(prefix, prompt, seed)
        llm = self.engines[mode]
        if mode != "cold":
            self._populate(llm, prefix, seed, evict=mode in ("host", "disk"))
        hits_before = _tier_hits(llm, mode)
        seconds, out = self._timed(llm, prompt)
        return self._row(seconds, out, _tier_hits(llm, mode) - hits_before)

    def _measure_restart(self, prefix: list[int], prompt: list[int], seed: int) -> dict[str, Any]:
        flags = {**self.pools, "disk_cache_dir": self._private_dir(f"restart-{seed}"),
                 "disk_cache_size": self.lower_tier_size, "tier_write_policy": "write-through"}
        writer = self.llm_class(**flags)
        self._populate(writer, prefix, seed, evict=False)
        writer.llm_engine.shutdown()
        reader = self.llm_class(**flags)
        # one short unrelated request first, as the warm engines have served: the timed one then pays
        # for the restore, not for the process's first kernel launches (Triton JIT, cuBLAS set-up)
        reader.generate([_tokens(self.fresh_tokens, seed + 7)], self.params, use_tqdm=False)
        seconds, out = self._timed(reader, prompt)
        row = self._row(seconds, out, _tier_hits(reader, "disk"))
        reader.llm_engine.shutdown()
        return row

    def profile(self, mode: str, seed: int, path: Path) -> None:
        """One more `mode` sample with the timed request under cProfile; the functions that took the
        most time (cumulative, then own) go to `path`, to see where a restore's time goes."""
        prefix = _tokens(self.prefix_tokens, seed)
        prompt = prefix + _tokens(self.fresh_tokens, seed + 2)
        llm = self.engines[mode]
        if mode != "cold":
            self._populate(llm, prefix, seed, evict=mode in ("host", "disk"))
        profiler = cProfile.Profile()
        profiler.enable()
        seconds, _ = self._timed(llm, prompt)
        profiler.disable()
        text = io.StringIO()
        text.write(f"{mode}: {seconds * 1e3:.1f} ms\n")
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("cumulative").print_stats(PROFILE_ROWS)
        stats.sort_stats("tottime").print_stats(PROFILE_ROWS)
        with path.open("a") as out:
            out.write(text.getvalue())

    @staticmethod
    def _row(seconds: float, out: Any, tier_hits: int) -> dict[str, Any]:
        completion = out.outputs[0]
        return {"seconds": seconds, "cached": out.num_cached_tokens, "tier_hits": tier_hits,
                "token": completion.token_ids, "logprobs": completion.logprobs}

    def close(self) -> None:
        """Shut every engine down."""
        for llm in self.engines.values():
            llm.llm_engine.shutdown()


def _same_output(row: dict[str, Any], reference: dict[str, Any], atol: float) -> bool:
    if row["token"] != reference["token"]:
        return False
    for got, want in zip(row["logprobs"], reference["logprobs"], strict=True):
        if got.keys() != want.keys() or max(abs(got[t] - want[t]) for t in got) > atol:
            return False
    return True


def _check(mode: str, row: dict[str, Any], prefix_tokens: int) -> list[str]:
    """What is wrong with a warm row: fewer tokens restored than the prefix, or no hit on its tier."""
    problems = []
    if mode != "cold" and row["cached"] < prefix_tokens:
        problems.append(f"{mode}: {row['cached']} tokens restored, expected {prefix_tokens}")
    if mode in ("host", "disk", "restart") and row["tier_hits"] != 1:
        problems.append(f"{mode}: {row['tier_hits']} hits on its tier, expected 1")
    return problems


def run_tier_ttft(prefix_tokens: int = 4096, fresh_tokens: int = 64, rounds: int = 3,
                  kv_cache_mib: float | None = None, prefix_cache_mib: float | None = None,
                  snapshot_interval: int | None = None, model: str | None = None,
                  log: Callable[[str], None] = print, device: str = "cpu", dtype: str = "float32",
                  profile: Path | None = None, write_policy: str = "write-through") -> dict[str, Any]:
    """Median TTFT per mode over `rounds` rounds after one warm-up round, modes alternated;
    the `interval` cache policy snapshots every `snapshot_interval` tokens (default: the prefix
    length, so the one snapshot a prompt leaves is the prefix's own boundary). With `profile`,
    one more device and host sample each, profiled, after the timed rounds (not in the medians)."""
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    cached: dict[str, int] = {}
    problems: list[str] = []
    identical = True
    with tempfile.TemporaryDirectory(prefix="tier-ttft-") as tmp:
        bench = TierBench(prefix_tokens, fresh_tokens, kv_cache_mib, prefix_cache_mib,
                          snapshot_interval or prefix_tokens, Path(tmp), device, dtype, model, write_policy)
        try:
            for round_index in range(rounds + 1):
                seed = 1000 * (round_index + 1)
                order = MODES[round_index % len(MODES):] + MODES[:round_index % len(MODES)]
                rows = {mode: bench.measure(mode, seed) for mode in order}
                for mode in MODES:
                    problems += _check(mode, rows[mode], prefix_tokens)
                    identical = identical and _same_output(rows[mode], rows["cold"], LOGPROB_ATOL[dtype])
                    cached[mode] = rows[mode]["cached"]
                    if round_index > 0:  # round 0 warms up
                        times[mode].append(rows[mode]["seconds"])
                log(f"round {round_index}{' (warm-up)' if round_index == 0 else ''}: " +
                    ", ".join(f"{mode} {rows[mode]['seconds']:.3f}s" for mode in MODES))
            if profile is not None:
                for mode in ("device", "host"):
                    bench.profile(mode, 1000 * (rounds + 2), profile)
        finally:
            bench.close()
    median = {mode: statistics.median(values) for mode, values in times.items()}
    return {"device": device, "dtype": dtype, "prefix_tokens": prefix_tokens, "fresh_tokens": fresh_tokens,
            "rounds": rounds,
            "median_s": median, "cached_tokens": cached, "identical_outputs": identical, "problems": problems,
            "host_over_device": median["host"] / median["device"],
            "disk_over_device": median["disk"] / median["device"],
            "restart_over_cold": median["restart"] / median["cold"]}


def format_tier_ttft_report(result: dict[str, Any]) -> str:
    """A plain table of the medians and the goal ratios."""
    lines = [f"{result['device']} {result['dtype']}; TTFT = wall time of LLM.generate, max_tokens=1, "
             f"{result['prefix_tokens']}-token prefix + "
             f"{result['fresh_tokens']} fresh tokens, median of {result['rounds']} after a warm-up",
             f"{'mode':8} {'TTFT s':>8} {'restored':>9}"]
    for mode in MODES:
        lines.append(f"{mode:8} {result['median_s'][mode]:8.3f} {result['cached_tokens'][mode]:9d}")
    lines += [f"host/device {result['host_over_device']:.2f}x (goal <= 1.3)",
              f"disk/device {result['disk_over_device']:.2f}x (goal <= 2)",
              f"restart/cold {result['restart_over_cold']:.3f}x (goal <= 0.1)",
              f"outputs identical across modes: {result['identical_outputs']}"]
    lines += [f"PROBLEM {problem}" for problem in result["problems"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the table (optionally write JSON); non-zero when a warm mode missed its tier."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tier_ttft", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up (median)")
    parser.add_argument("--prefix-tokens", type=int, default=4096, help="shared prefix restored from a tier")
    parser.add_argument("--fresh-tokens", type=int, default=64, help="new tokens after the prefix")
    parser.add_argument("--kv-cache-mib", type=float, default=None,
                        help="device KV pool (default: just under two prompts, from the model's block size)")
    parser.add_argument("--prefix-cache-mib", type=float, default=None,
                        help="device snapshot pool (default: two and a half snapshots)")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    parser.add_argument("--snapshot-interval", type=int, default=None, help="default: --prefix-tokens")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default=None, choices=sorted(LOGPROB_ATOL),
                        help="default: float32 on the CPU, bfloat16 on CUDA")
    parser.add_argument("--tier-write-policy", default="write-through", choices=TIER_WRITE_POLICIES,
                        help="the host and disk engines' write policy (the server's default: write-through)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the figures as JSON here")
    parser.add_argument("--profile", metavar="PATH", default=None,
                        help="append cProfile listings of one more device and host request to PATH")
    args = parser.parse_args(argv)
    result = run_tier_ttft(args.prefix_tokens, args.fresh_tokens, args.rounds, args.kv_cache_mib,
                           args.prefix_cache_mib, args.snapshot_interval, args.model, device=args.device,
                           dtype=args.dtype or ("float32" if args.device == "cpu" else "bfloat16"),
                           profile=Path(args.profile) if args.profile else None,
                           write_policy=args.tier_write_policy)
    print(format_tier_ttft_report(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

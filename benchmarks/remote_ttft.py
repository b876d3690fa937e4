"""`python -m benchmarks.remote_ttft`: TTFT of a conversation's next turn on a replica that did not
serve the previous one, restored from the shared remote tier (a local redis-server) against recomputed.

Built-in model, greedy, `max_tokens=1`: TTFT is the wall time of one `LLM.generate` call. Each round
draws a new conversation: turn one (`--prefix-tokens` tokens) runs on replica A, whose end state and
prefix KV are written through to the store; turn two (turn one, its answer and `--fresh-tokens` new
tokens) is then timed three ways, the cold run's place rotating per round (the device run always
precedes the remote one, so replica A never restores B's deeper end-of-turn-two entry):

- cold: an engine with the prefix cache off recomputes it all;
- remote: replica B, which never saw the conversation, finds turn one's entry in the store
  (discovery lookup), promotes it and computes only the rest;
- device: replica A serves it from its own device cache (the ceiling a perfect router reaches).

A and B share the store and a block-hash seed, as replicas must. Each row checks the restored
token count (and, for remote, one hit on the remote tier) and that the outputs (token and
logprobs) match the cold run. The first round is a warm-up; the report gives medians and
remote/cold, remote/device.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.tier_ttft import _same_output, _tokens  # the same prompts and output check as the tier benchmark

MODES = ("cold", "remote", "device")
ORDERS = (("cold", "device", "remote"), ("device", "cold", "remote"), ("device", "remote", "cold"))
SEED = 0x5EED


def start_redis(directory: Path, maxmemory: str = "1gb") -> tuple[subprocess.Popen[bytes], str]:
    """A private redis-server on a free port (no persistence, LRU under `maxmemory`) and its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory),
                                "--save", "", "--appendonly", "no", "--maxmemory", maxmemory,
                                "--maxmemory-policy", "allkeys-lru"], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return process, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise SystemExit("redis-server did not start")


def _settle(llm: Any) -> None:
    """Let the replica's write-through finish (the conversation's next turn comes later in life)."""
    mover = llm.llm_engine.tier_mover
    while mover is not None and mover.busy:
        llm.llm_engine.cache.poll_tiers()
        mover.wait(0.01)
    llm.llm_engine.cache.poll_tiers()


def _remote_hits(llm: Any) -> int:
    return sum(stats.hits for stats in llm.tier_stats() if stats.name == "remote")


class RemoteBench:
    """Replicas A and B on one store, a cold engine, and the per-mode measurement of one round."""

    def __init__(self, url: str, prefix_tokens: int, fresh_tokens: int, kv_cache_mib: float,
                 prefix_cache_mib: float) -> None:
        from hybridserve import LLM, SamplingParams

        self.params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=2)
        self.prefix_tokens, self.fresh_tokens = prefix_tokens, fresh_tokens
        pools: dict[str, Any] = {"device": "cpu", "dtype": "float32", "kv_cache_mib": kv_cache_mib,
                                 "prefix_cache_mib": prefix_cache_mib}
        replica = {**pools, "remote_cache_url": url, "block_hash_seed": SEED}
        self.a, self.b = LLM(**replica), LLM(**replica)
        self.cold = LLM(device="cpu", dtype="float32", kv_cache_mib=kv_cache_mib, prefix_cache_mib=0)

    def _timed(self, llm: Any, prompt: list[int]) -> tuple[float, Any]:
        start = time.perf_counter()
        out = llm.generate([prompt], self.params, use_tqdm=False)[0]
        return time.perf_counter() - start, out

    def round(self, seed: int, order: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        """Turn one on A (settled into the store), then turn two timed in each mode of `order`."""
        first = _tokens(self.prefix_tokens, seed)
        answer = self.a.generate([first], self.params, use_tqdm=False)[0].outputs[0].token_ids
        _settle(self.a)
        second = first + answer + _tokens(self.fresh_tokens, seed + 1)
        engines = {"cold": self.cold, "remote": self.b, "device": self.a}
        rows = {}
        for mode in order:
            hits = _remote_hits(self.b)
            seconds, out = self._timed(engines[mode], second)
            completion = out.outputs[0]
            rows[mode] = {"seconds": seconds, "cached": out.num_cached_tokens,
                          "remote_hits": _remote_hits(self.b) - hits,
                          "token": completion.token_ids, "logprobs": completion.logprobs}
        _settle(self.b)
        return rows

    def remote_stats(self) -> dict[str, int]:
        """Replica B's remote tier counters."""
        stats = next(s for s in self.b.tier_stats() if s.name == "remote")
        return {k: v for k, v in stats._asdict().items() if k != "name"}

    def close(self) -> None:
        """Shut every engine down."""
        for llm in (self.a, self.b, self.cold):
            llm.llm_engine.shutdown()



def run_remote_ttft(prefix_tokens: int = 4096, fresh_tokens: int = 64, rounds: int = 3, kv_cache_mib: float = 16,
                    prefix_cache_mib: float = 2, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Median TTFT per mode over `rounds` rounds after one warm-up round, modes rotated."""
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    cached: dict[str, int] = {}
    problems: list[str] = []
    identical = True
    with tempfile.TemporaryDirectory(prefix="remote-ttft-") as tmp:
        server, url = start_redis(Path(tmp))
        try:
            bench = RemoteBench(url, prefix_tokens, fresh_tokens, kv_cache_mib, prefix_cache_mib)
            try:
                for index in range(rounds + 1):
                    order = ORDERS[index % len(ORDERS)]
                    rows = bench.round(1000 * (index + 1), order)
                    for mode in MODES:
                        identical = identical and _same_output(rows[mode], rows["cold"])
                        cached[mode] = rows[mode]["cached"]
                        if mode != "cold" and rows[mode]["cached"] < prefix_tokens:
                            problems.append(f"{mode}: {rows[mode]['cached']} tokens restored, expected "
                                            f">= {prefix_tokens}")
                        if index > 0:
                            times[mode].append(rows[mode]["seconds"])
                    if rows["remote"]["remote_hits"] != 1:
                        problems.append(f"remote: {rows['remote']['remote_hits']} remote hits, expected 1")
                    log(f"round {index}{' (warm-up)' if index == 0 else ''}: " +
                        ", ".join(f"{mode} {rows[mode]['seconds']:.3f}s" for mode in MODES))
                stats = bench.remote_stats()
            finally:
                bench.close()
        finally:
            server.kill()
            server.wait()
    median = {mode: statistics.median(values) for mode, values in times.items()}
    return {"prefix_tokens": prefix_tokens, "fresh_tokens": fresh_tokens, "rounds": rounds, "median_s": median,
            "cached_tokens": cached, "identical_outputs": identical, "problems": problems,
            "remote_over_cold": median["remote"] / median["cold"],
            "remote_over_device": median["remote"] / median["device"], "remote_tier": stats}


def format_remote_ttft_report(result: dict[str, Any]) -> str:
    """A plain table of the medians and the ratios."""
    lines = [f"TTFT = wall time of LLM.generate, max_tokens=1; turn two = {result['prefix_tokens']}-token turn one + "
             f"its answer + {result['fresh_tokens']} fresh tokens; median of {result['rounds']} after a warm-up",
             f"{'mode':8} {'TTFT s':>8} {'restored':>9}"]
    for mode in MODES:
        lines.append(f"{mode:8} {result['median_s'][mode]:8.3f} {result['cached_tokens'][mode]:9d}")
    tier = result["remote_tier"]
    lines += [f"remote/cold {result['remote_over_cold']:.3f}x, remote/device {result['remote_over_device']:.2f}x",
              f"replica B's remote tier: {tier['lookups']} lookups, {tier['hits']} hits, "
              f"{tier['promoted_bytes'] / 2**20:.1f} MiB promoted, {tier['failed']} failed",
              f"outputs identical across modes: {result['identical_outputs']}"]
    lines += [f"PROBLEM {problem}" for problem in result["problems"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the table (optionally write JSON); non-zero when a warm mode missed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.remote_ttft", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up (median)")
    parser.add_argument("--prefix-tokens", type=int, default=4096, help="turn one's prompt")
    parser.add_argument("--fresh-tokens", type=int, default=64, help="new tokens in turn two")
    parser.add_argument("--kv-cache-mib", type=float, default=16, help="device KV pool of each engine")
    parser.add_argument("--prefix-cache-mib", type=float, default=2, help="device snapshot pool: a few slots")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    result = run_remote_ttft(args.prefix_tokens, args.fresh_tokens, args.rounds, args.kv_cache_mib,
                             args.prefix_cache_mib)
    print(format_remote_ttft_report(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m benchmarks.threads`: decode speed idle vs with one core kept busy by another process.

Each thread setting runs in its own worker process (the OpenMP wait policy is read when torch
loads), decoding greedily on the configured engine; a second process spinning in a loop plays the
"busy machine". Idle and busy runs alternate per setting and the report gives busy/idle ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from hybridserve.bench.configs import add_config_arguments, config_from_args, option
from hybridserve.engine.threads import available_cores

BUSY_LOOP = "import time\nend = time.monotonic() + 600\nwhile time.monotonic() < end:\n    pass\n"
REPO_ROOT = Path(__file__).resolve().parents[1]  # the workers run `-m benchmarks.threads` from here


@dataclass(frozen=True)
class ThreadsBenchConfig:
    """What the threads benchmark measures."""

    rounds: int = option(3, "idle/busy pairs per setting (median)")
    prompt_tokens: int = 32
    decode_tokens: int = option(48, "tokens decoded per run")


class ThreadSetting(NamedTuple):
    """One configuration to measure."""

    name: str
    threads: int
    wait_policy: str | None   # OMP_WAIT_POLICY for the worker; None: the runtime's default
    spin_count: str | None = None  # GOMP_SPINCOUNT for the worker; None: unset


def default_settings() -> list[ThreadSetting]:
    """torch's default (every core, OpenMP's own wait policy) against hybridserve's default (passive
    wait after a short spin) and its parts."""
    from hybridserve.engine.threads import OPENMP_SPIN_COUNT

    cores = available_cores()
    return [
        ThreadSetting(f"torch default ({cores} threads, OpenMP default wait)", cores, None),
        ThreadSetting(f"hybridserve default ({cores} threads, passive wait after {OPENMP_SPIN_COUNT} spins)", cores,
                      "PASSIVE", OPENMP_SPIN_COUNT),
        ThreadSetting(f"passive wait, no spin ({cores} threads)", cores, "PASSIVE", "0"),
        ThreadSetting(f"all cores but one ({max(1, cores - 1)} threads, passive wait)", max(1, cores - 1),
                      "PASSIVE", "0"),
    ]


def _worker_command(setting: ThreadSetting, prompt_tokens: int, decode_tokens: int) -> tuple[list[str], dict]:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("OMP_NUM_THREADS", None)
    env.pop("GOMP_SPINCOUNT", None)
    if setting.spin_count is not None:
        env["GOMP_SPINCOUNT"] = setting.spin_count
    if setting.wait_policy is not None:
        env["OMP_WAIT_POLICY"] = setting.wait_policy
    else:
        env["OMP_WAIT_POLICY"] = ""  # explicit and empty: the OpenMP default
    command = [sys.executable, "-m", "benchmarks.threads", "--worker-threads", str(setting.threads),
               "--prompt-tokens", str(prompt_tokens), "--decode-tokens", str(decode_tokens)]
    return command, env


def _run_worker(setting: ThreadSetting, prompt_tokens: int, decode_tokens: int, timeout: float) -> float:
    command, env = _worker_command(setting, prompt_tokens, decode_tokens)
    done = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                          check=True)
    return float(json.loads(done.stdout.strip().splitlines()[-1])["decode_ms_per_token"])


def run_threads_bench(prompt_tokens: int = 32, decode_tokens: int = 48, rounds: int = 2,
                      settings: list[ThreadSetting] | None = None, timeout: float = 300.0) -> dict[str, Any]:
    """Median decode ms/token per setting, idle and busy, and their ratio."""
    rows = []
    for setting in settings or default_settings():
        idle, busy = [], []
        for _ in range(rounds):
            idle.append(_run_worker(setting, prompt_tokens, decode_tokens, timeout))
            spinner = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
            try:
                time.sleep(0.2)
                busy.append(_run_worker(setting, prompt_tokens, decode_tokens, timeout))
            finally:
                spinner.kill()
                spinner.wait()
        idle_ms, busy_ms = sorted(idle)[len(idle) // 2], sorted(busy)[len(busy) // 2]
        rows.append({"setting": setting.name, "threads": setting.threads, "wait_policy": setting.wait_policy,
                     "idle_ms_per_token": idle_ms, "busy_ms_per_token": busy_ms, "busy_over_idle": busy_ms / idle_ms})
    return {"cores": available_cores(), "prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens,
            "rounds": rounds, "rows": rows}


def format_threads_report(result: dict[str, Any]) -> str:
    """A plain table of the figures."""
    lines = [f"decode ms/token, {result['cores']} cores, one core kept busy by another process "
             f"({result['decode_tokens']} tokens after a {result['prompt_tokens']}-token prompt, "
             f"median of {result['rounds']})",
             f"{'setting':66} {'idle':>8} {'busy':>8} {'busy/idle':>9}"]
    for row in result["rows"]:
        lines.append(f"{row['setting']:66} {row['idle_ms_per_token']:8.1f} {row['busy_ms_per_token']:8.1f} "
                     f"{row['busy_over_idle']:8.1f}x")
    return "\n".join(lines)


def _measure_decode(threads: int, prompt_tokens: int, decode_tokens: int) -> float:
    """Worker: median ms per decode step of one greedy request on the built-in model (CPU)."""
    from hybridserve.config import CacheConfig, EngineConfig
    from hybridserve.engine.engine import LLMEngine
    from hybridserve.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", num_threads=threads,
                                    cache=CacheConfig(kv_cache_mib=16, prefix_cache_mib=0)))
    params = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    prompt = list(range(300, 300 + prompt_tokens))
    for attempt in range(2):  # the first run warms up
        engine.add_request(f"decode-{attempt}", prompt, params)
        engine.step()  # prefill + first token
        steps = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
    steps.sort()
    return 1000 * steps[len(steps) // 2]


def main(argv: list[str] | None = None) -> int:
    """Print the table (optionally write JSON); with `--worker-threads N`, be one measuring worker
    and print its figure as one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.threads", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_arguments(parser, ThreadsBenchConfig)
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the figures as JSON here")
    parser.add_argument("--worker-threads", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--prompt-tokens", type=int, default=ThreadsBenchConfig.prompt_tokens, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_threads is not None:
        ms = _measure_decode(args.worker_threads, args.prompt_tokens, args.decode_tokens)
        print(json.dumps({"decode_ms_per_token": ms}))
        return 0
    cfg = config_from_args(ThreadsBenchConfig, args)
    result = run_threads_bench(prompt_tokens=cfg.prompt_tokens, decode_tokens=cfg.decode_tokens, rounds=cfg.rounds)
    print(format_threads_report(result), flush=True)
    if args.json:
        from hybridserve.bench.common import write_json

        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

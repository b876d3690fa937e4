"""`hybridserve bench serve`: load test of a live OpenAI-compatible server over HTTP.

By default a `hybridserve serve` subprocess is started on a free 127.0.0.1 port with the bench's
engine flags, awaited on `/health` and stopped (SIGTERM) at the end; `--url` targets a running
server instead. Every request is a streamed `POST /v1/completions` with token-id prompts,
greedy sampling, `ignore_eos` and a fixed `max_tokens`, plus `stream_options.include_usage` so
the final chunk reports prompt, completion and cached tokens.

Workloads, each run at every concurrency level (clients issue requests back to back until the
level's request budget is spent):
  * shared-prefix: one common prefix (warmed once beforehand) + a unique suffix per request;
  * no-reuse: unique random prompts of the same total length.
Per level: TTFT p50/p99 (send -> first chunk with a choice), ITL p50/p99 (gaps between chunks
with a choice; every such chunk carries a new token, and with `logprobs: 0` requested, the
default, every token gets its own chunk), requests/s, output tokens/s,
cached-token share (sum cached_tokens / sum prompt_tokens).

Mixed load: N background requests decode long outputs; once each is past its first token and
has streamed a baseline, one long request is injected whose prefix was sent once beforehand
(warm) plus a fresh suffix. The background ITL p99 during the injection window (send of the
injected request -> its last chunk) is compared with their baseline ITL p50 before it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridserve.bench.common import FIRST_PLAIN_ID, PLAIN_ID_SPAN, format_table, goal_mark, random_token_ids, \
    write_json
from hybridserve.bench.serve_compare import add_compare_arguments
from hybridserve.engine_args import add_engine_arguments, engine_config_from_args

if TYPE_CHECKING:
    import httpx

MIXED_ITL_GOAL = 3.0         # background ITL p99 under injection / their baseline ITL p50
POLL_S = 0.005               # controller polling period of the mixed case
WORKLOADS = ("shared-prefix", "no-reuse")


@dataclass(frozen=True)
class ServeBenchConfig:
    """Sizes of `bench serve` (token counts are prompt token ids sent as-is)."""

    concurrency: tuple[int, ...] = (1, 4, 8, 16)
    num_requests: int = 32
    prefix_tokens: int = 1024
    suffix_tokens: int = 64
    max_tokens: int = 32
    workloads: tuple[str, ...] = WORKLOADS
    mixed: bool = True
    mixed_background: int = 4
    mixed_background_prompt_tokens: int = 64
    mixed_background_max_tokens: int = 1024
    mixed_baseline_chunks: int = 16
    mixed_prefix_tokens: int = 2048
    mixed_suffix_tokens: int = 128
    mixed_max_tokens: int = 8
    token_logprobs: bool = True
    request_timeout_s: float = 300.0
    level_timeout_s: float = 900.0
    seed: int = 0


# =========================================================================== statistics
def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; NaN when empty."""
    data = sorted(values)
    if not data:
        return float("nan")
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def _ms(seconds: float) -> float:
    return round(1000.0 * seconds, 3) if math.isfinite(seconds) else float("nan")


@dataclass
class RequestRecord:
    """Client-side timeline and final usage of one streamed completion."""

    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        """Seconds from send to the first token-carrying chunk (NaN if none came)."""
        return self.chunk_times[0] - self.start if self.chunk_times else float("nan")

    def gaps(self) -> list[tuple[float, float]]:
        """(previous chunk time, chunk time) pairs after the first chunk."""
        return list(zip(self.chunk_times, self.chunk_times[1:]))


def summarize(records: Sequence[RequestRecord], wall_s: float) -> dict[str, Any]:
    """Latency percentiles, rates and cache share of one (workload, concurrency) run."""
    ok = [r for r in records if r.error is None]
    itl = [b - a for r in ok for a, b in r.gaps()]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.completion_tokens for r in ok)
    return {
        "requests": len(records), "errors": len(records) - len(ok),
        "first_error": next((r.error for r in records if r.error), None),
        "wall_s": round(wall_s, 3),
        "ttft_p50_ms": _ms(percentile([r.ttft for r in ok], 50)),
        "ttft_p99_ms": _ms(percentile([r.ttft for r in ok], 99)),
        "itl_p50_ms": _ms(percentile(itl, 50)), "itl_p99_ms": _ms(percentile(itl, 99)),
        "requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else float("nan"),
        "output_tokens_per_s": round(output / wall_s, 1) if wall_s > 0 else float("nan"),
        "prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": output,
        "cached_share": round(cached / prompt, 4) if prompt else float("nan"),
    }


# =========================================================================== prompts
class PromptSource:
    """Random ordinary token ids, a fresh seed per call, so no two prompts share a block by accident."""

    def __init__(self, seed: int) -> None:
        self._seeds = itertools.count(seed * 1_000_003)

    def fresh(self, num_tokens: int) -> list[int]:
        """`num_tokens` random ids never handed out before by this source."""
        return random_token_ids(num_tokens, next(self._seeds), FIRST_PLAIN_ID + PLAIN_ID_SPAN)


# =========================================================================== HTTP client
class CompletionClient:
    """Streams `/v1/completions` requests and records their timelines."""

    def __init__(self, client: "httpx.AsyncClient", model: str | None, token_logprobs: bool = True) -> None:
        self.client = client
        self.model = model
        self.token_logprobs = token_logprobs

    def body(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        """The request body: greedy, EOS ignored, streamed with a final usage chunk. With
        `token_logprobs`, `logprobs: 0` makes every generated token produce a chunk even when its
        text is empty so far (a partial UTF-8 character), so chunk gaps are token gaps."""
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        if self.token_logprobs:
            body["logprobs"] = 0
        return body

    async def stream(self, prompt: list[int], max_tokens: int, record: RequestRecord | None = None) -> RequestRecord:
        """Send one request and read its stream to the end; errors are recorded, not raised
        (cancellation is re-raised after closing the connection, which aborts the request)."""
        record = record if record is not None else RequestRecord()
        record.start = time.perf_counter()
        try:
            await self._exchange(self.body(prompt, max_tokens), record)
        except asyncio.CancelledError:
            record.error = record.error or "cancelled"
            raise
        except Exception as exc:  # noqa: BLE001 - a failed request is a data point, not a crash
            record.error = f"{type(exc).__name__}: {exc}"
        finally:
            record.end = time.perf_counter()
        return record

    async def _exchange(self, body: dict[str, Any], record: RequestRecord) -> None:
        """POST `body` and feed the response's lines to `_on_line` (an error status is recorded)."""
        async with self.client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                record.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return
            async for line in resp.aiter_lines():
                if not self._on_line(line, record):
                    break

    @staticmethod
    def _on_line(line: str, record: RequestRecord) -> bool:
        """Consume one SSE line; False at `[DONE]`."""
        if not line.startswith("data:"):
            return True
        payload = line[5:].strip()
        if payload == "[DONE]":
            return False
        now = time.perf_counter()
        chunk = json.loads(payload)
        if "error" in chunk:
            record.error = str(chunk["error"].get("message", chunk["error"]))
            return False
        if chunk.get("choices"):
            record.chunk_times.append(now)
        usage = chunk.get("usage")
        if usage:
            record.prompt_tokens = int(usage.get("prompt_tokens", 0))
            record.completion_tokens = int(usage.get("completion_tokens", 0))
            details = usage.get("prompt_tokens_details") or {}
            record.cached_tokens = int(details.get("cached_tokens") or 0)
        return True


class AiohttpCompletionClient(CompletionClient):
    """The same requests and records over aiohttp, the HTTP client of vLLM's and SGLang's serving
    benchmarks. A client on the server's own cores takes CPU from the engine: on the 2-core host,
    16 streams cost this client ~46 us of CPU per token and the httpx client ~109 (BENCHMARKS.md)."""

    def __init__(self, session: Any, base_url: str, model: str | None, token_logprobs: bool = True) -> None:
        super().__init__(None, model, token_logprobs)  # type: ignore[arg-type]
        self.session = session
        self.url = base_url.rstrip("/") + "/v1/completions"

    async def _exchange(self, body: dict[str, Any], record: RequestRecord) -> None:
        async with self.session.post(self.url, json=body) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.read())[:300]!r}"
                return
            async for line in resp.content:
                if not self._on_line(line.decode(), record):
                    break


class AiohttpWholeCompletionClient(AiohttpCompletionClient):
    """The same requests not streamed (`stream: false`) over aiohttp: the server's cost without
    its per-token streaming. The whole response arrives at once, so its first "chunk" time is the
    request's end."""

    def body(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        """The streamed body without streaming."""
        body = super().body(prompt, max_tokens)
        del body["stream_options"]
        body["stream"] = False
        return body

    async def _exchange(self, body: dict[str, Any], record: RequestRecord) -> None:
        async with self.session.post(self.url, json=body) as resp:
            data = await resp.read()
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {data[:300]!r}"
                return
        record.chunk_times.append(time.perf_counter())
        usage = json.loads(data)["usage"]
        record.prompt_tokens, record.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        record.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


# =========================================================================== workloads
async def run_level(api: CompletionClient, prompts: Sequence[list[int]], concurrency: int, max_tokens: int,
                    timeout_s: float) -> tuple[list[RequestRecord], float]:
    """`concurrency` clients take prompts from a shared list back to back; returns records and wall time.
    Clients stop taking new prompts after `timeout_s`."""
    queue = list(reversed(prompts))
    records: list[RequestRecord] = []
    start = time.perf_counter()
    deadline = start + timeout_s

    async def client_loop() -> None:
        while queue and time.perf_counter() < deadline:
            records.append(await api.stream(queue.pop(), max_tokens))

    await asyncio.gather(*(client_loop() for _ in range(max(1, min(concurrency, len(prompts))))))
    return records, time.perf_counter() - start


def workload_prompts(kind: str, source: PromptSource, prefix: list[int], cfg: ServeBenchConfig) -> list[list[int]]:
    """`cfg.num_requests` prompts of one workload (the shared prefix is only used by shared-prefix)."""
    if kind == "shared-prefix":
        return [prefix + source.fresh(cfg.suffix_tokens) for _ in range(cfg.num_requests)]
    return [source.fresh(cfg.prefix_tokens + cfg.suffix_tokens) for _ in range(cfg.num_requests)]


async def run_workload(api: CompletionClient, kind: str, source: PromptSource,
                       cfg: ServeBenchConfig) -> list[dict[str, Any]]:
    """One row per concurrency level; one unmeasured request first (warms the prefix / the server)."""
    prefix = source.fresh(cfg.prefix_tokens)
    warm = await api.stream(workload_prompts(kind, source, prefix, dataclasses.replace(cfg, num_requests=1))[0], 1)
    if warm.error:
        raise RuntimeError(f"warm-up request failed: {warm.error}")
    rows = []
    for level in cfg.concurrency:
        prompts = workload_prompts(kind, source, prefix, cfg)
        records, wall = await run_level(api, prompts, level, cfg.max_tokens, cfg.level_timeout_s)
        rows.append({"workload": kind, "concurrency": level, **summarize(records, wall)})
        print(f"[bench] {kind} c={level}: {rows[-1]['requests']} requests in {wall:.1f} s", file=sys.stderr)
    return rows


# =========================================================================== mixed load
async def _wait_for(condition: Callable[[], bool], deadline: float, what: str) -> None:
    while not condition():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"mixed case: timed out waiting for {what}")
        await asyncio.sleep(POLL_S)


def _background_ready(records: Sequence[RequestRecord], tasks: Sequence[asyncio.Task], need: int) -> bool:
    if any(task.done() for task in tasks):
        raise RuntimeError("mixed case: a background request ended before the injection "
                           f"(error: {next((r.error for r in records if r.error), None)}); raise its max_tokens")
    if not all(r.chunk_times for r in records):
        return False
    started = max(r.chunk_times[0] for r in records)
    return all(sum(t > started for t in r.chunk_times) >= need for r in records)


def mixed_summary(background: Sequence[RequestRecord], injected: RequestRecord, warm: RequestRecord) -> dict[str, Any]:
    """Background ITL before vs during the injection window, and the injected request's figures."""
    started = max(r.chunk_times[0] for r in background)
    window_end = injected.chunk_times[-1] if injected.chunk_times else injected.end
    gaps = [(a, b) for r in background for a, b in r.gaps()]
    baseline = [b - a for a, b in gaps if a >= started and b <= injected.start]
    during = [b - a for a, b in gaps if b > injected.start and a < window_end]
    base_p50, inj_p99 = percentile(baseline, 50), percentile(during, 99)
    ratio = inj_p99 / base_p50 if baseline and during and base_p50 > 0 else float("nan")
    return {
        "background": len(background), "baseline_gaps": len(baseline), "injection_gaps": len(during),
        "baseline_itl_p50_ms": _ms(base_p50), "injection_itl_p99_ms": _ms(inj_p99),
        "injection_itl_max_ms": _ms(max(during, default=float("nan"))),
        "injection_window_ms": _ms(window_end - injected.start),
        "itl_ratio": round(ratio, 3) if math.isfinite(ratio) else float("nan"),
        "goal_ratio": MIXED_ITL_GOAL, "goal_met": bool(ratio <= MIXED_ITL_GOAL) if math.isfinite(ratio) else None,
        "injected_ttft_ms": _ms(injected.ttft), "injected_prompt_tokens": injected.prompt_tokens,
        "injected_cached_tokens": injected.cached_tokens, "injected_error": injected.error,
        "warmup_ttft_ms": _ms(warm.ttft), "warmup_cached_tokens": warm.cached_tokens,
    }


async def run_mixed(api: CompletionClient, source: PromptSource, cfg: ServeBenchConfig) -> dict[str, Any]:
    """Warm the long prefix, start the background decoders, inject the long request, then cancel them."""
    prefix = source.fresh(cfg.mixed_prefix_tokens)
    warm = await api.stream(prefix + source.fresh(cfg.mixed_suffix_tokens), 1)
    if warm.error:
        raise RuntimeError(f"mixed case: warm-up request failed: {warm.error}")
    background = [RequestRecord() for _ in range(cfg.mixed_background)]
    tasks = [asyncio.create_task(api.stream(source.fresh(cfg.mixed_background_prompt_tokens),
                                            cfg.mixed_background_max_tokens, record)) for record in background]
    try:
        deadline = time.perf_counter() + cfg.request_timeout_s
        await _wait_for(lambda: _background_ready(background, tasks, cfg.mixed_baseline_chunks), deadline,
                        "the background baseline")
        injected = await api.stream(prefix + source.fresh(cfg.mixed_suffix_tokens), cfg.mixed_max_tokens)
        if any(task.done() for task in tasks):
            print("[bench] mixed case: a background request ended inside the injection window; "
                  "raise --mixed-background-max-tokens", file=sys.stderr)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return mixed_summary(background, injected, warm)


# =========================================================================== server process
def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`hybridserve serve` in a subprocess on a free loopback port, stopped with SIGTERM on exit."""

    health_path = "/health"  # polled until it answers 200

    def __init__(self, serve_args: Sequence[str], *, start_timeout_s: float = 180.0,
                 threads: int | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "hybridserve.cli", "serve", *serve_args, "--host", "127.0.0.1",
                     "--port", str(self.port), "--log-level", "warning",
                     *(["--threads", str(threads)] if threads is not None else [])]
        self.start_timeout_s = start_timeout_s
        self.env = dict(os.environ)
        self._log = tempfile.NamedTemporaryFile(prefix="hybridserve-bench-serve-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        Path(self._log.name).unlink(missing_ok=True)

    def log_tail(self, chars: int = 2000) -> str:
        """The end of the server's output."""
        return Path(self._log.name).read_text(errors="replace")[-chars:]

    def _wait_healthy(self) -> None:
        import httpx

        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}{self.health_path}", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy after {self.start_timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM (the server shuts its engine down), then SIGKILL after 20 s."""
        if self.proc is None or self.proc.poll() is not None:
            self._log.close()
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


# =========================================================================== driver
async def _model_name(client: "httpx.AsyncClient") -> str | None:
    resp = await client.get("/v1/models")
    data = resp.json().get("data") if resp.status_code == 200 else None
    return data[0]["id"] if data else None


async def run_against(url: str, cfg: ServeBenchConfig, api_key: str | None = None) -> dict[str, Any]:
    """All workloads and the mixed case against the server at `url`."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    most = max([*cfg.concurrency, cfg.mixed_background + 1]) + 4
    limits = httpx.Limits(max_connections=most, max_keepalive_connections=most)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(cfg.request_timeout_s, connect=10.0)) as client:
        model = await _model_name(client)
        api = CompletionClient(client, model, cfg.token_logprobs)
        source = PromptSource(cfg.seed)
        rows = [row for kind in cfg.workloads for row in await run_workload(api, kind, source, cfg)]
        mixed = await run_mixed(api, source, cfg) if cfg.mixed else None
    return {"url": url, "model": model, "config": asdict(cfg), "rows": rows, "mixed": mixed}


def run_serve_bench(cfg: ServeBenchConfig, *, url: str | None = None, serve_args: Sequence[str] = (),
                    api_key: str | None = None, threads: int | None = None) -> dict[str, Any]:
    """Run the benchmark against `url`, or against a `hybridserve serve` subprocess started with
    `serve_args` (and stopped afterwards) when `url` is None."""
    if url is not None:
        result = asyncio.run(run_against(url.rstrip("/"), cfg, api_key))
        return {**result, "server": {"started": False}}
    with ServerProcess(serve_args, threads=threads) as server:
        result = asyncio.run(run_against(server.url, cfg, api_key))
        return {**result, "server": {"started": True, "argv": server.argv[2:]}}


# =========================================================================== report
def _fmt(value: Any, digits: int = 1) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def _share(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:.1f}%"


def format_serve_report(result: dict[str, Any]) -> str:
    """The workload table and the mixed-load lines."""
    headers = ["workload", "conc", "reqs", "err", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
               "req/s", "out tok/s", "cached"]
    rows = [[r["workload"], r["concurrency"], r["requests"], r["errors"], _fmt(r["ttft_p50_ms"]),
             _fmt(r["ttft_p99_ms"]), _fmt(r["itl_p50_ms"]), _fmt(r["itl_p99_ms"]), _fmt(r["requests_per_s"], 2),
             _fmt(r["output_tokens_per_s"]), _share(r["cached_share"])] for r in result["rows"]]
    cfg = result["config"]
    lines = [f"hybridserve bench serve: {result['url']} (model {result['model']}), prompts "
             f"{cfg['prefix_tokens']}+{cfg['suffix_tokens']} tokens, max_tokens {cfg['max_tokens']}, "
             f"{cfg['num_requests']} requests per level", format_table(headers, rows)]
    errors = [r for r in result["rows"] if r["first_error"]]
    lines += [f"  first error ({r['workload']}, c={r['concurrency']}): {r['first_error']}" for r in errors]
    mixed = result.get("mixed")
    if mixed:
        lines += [
            f"mixed load ({mixed['background']} background decoders, injected prompt "
            f"{mixed['injected_prompt_tokens']} tokens, {mixed['injected_cached_tokens']} cached):",
            f"  background ITL p50 before {_fmt(mixed['baseline_itl_p50_ms'])} ms ({mixed['baseline_gaps']} gaps), "
            f"p99 during injection {_fmt(mixed['injection_itl_p99_ms'])} ms ({mixed['injection_gaps']} gaps, "
            f"max {_fmt(mixed['injection_itl_max_ms'])} ms, window {_fmt(mixed['injection_window_ms'])} ms)",
            f"  ratio {_fmt(mixed['itl_ratio'], 2)}x (goal <= {MIXED_ITL_GOAL:g}x): {goal_mark(mixed['goal_met'])}; "
            f"injected TTFT {_fmt(mixed['injected_ttft_ms'])} ms (its warm-up: "
            f"{_fmt(mixed['warmup_ttft_ms'])} ms, {mixed['warmup_cached_tokens']} cached)",
        ]
        if mixed["injected_error"]:
            lines.append(f"  injected request error: {mixed['injected_error']}")
    return "\n".join(lines)


# =========================================================================== command line
def add_serve_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `bench serve` (the engine flags are forwarded to the server it starts)."""
    parser.add_argument("--url", default=None, help="benchmark this running server (engine flags then unused)")
    parser.add_argument("--api-key", default=None, help="bearer key for the server")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16], help="client counts")
    parser.add_argument("--num-requests", type=int, default=32, help="requests per (workload, concurrency)")
    parser.add_argument("--prefix-tokens", type=int, default=1024, help="shared prefix length")
    parser.add_argument("--suffix-tokens", type=int, default=64, help="unique suffix length")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (EOS ignored)")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS), help="workloads")
    parser.add_argument("--no-mixed", action="store_true", help="skip the mixed-load case")
    parser.add_argument("--mixed-background", type=int, default=4, help="background decoders")
    parser.add_argument("--mixed-background-prompt-tokens", type=int, default=64, help="their prompt length")
    parser.add_argument("--mixed-background-max-tokens", type=int, default=1024,
                        help="their output cap (they are cancelled after the injection)")
    parser.add_argument("--mixed-baseline-chunks", type=int, default=16,
                        help="chunks each background stream receives before the injection")
    parser.add_argument("--mixed-prefix-tokens", type=int, default=2048, help="warm prefix of the injected request")
    parser.add_argument("--mixed-suffix-tokens", type=int, default=128, help="its fresh suffix")
    parser.add_argument("--mixed-max-tokens", type=int, default=8, help="its output tokens")
    parser.add_argument("--no-logprobs", action="store_true",
                        help="do not request logprobs=0 (then tokens whose text is still empty send no chunk)")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--level-timeout", type=float, default=900.0,
                        help="seconds after which a level stops issuing requests")
    parser.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts")
    add_compare_arguments(parser)


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    """The `ServeBenchConfig` the flags describe."""
    return ServeBenchConfig(
        concurrency=tuple(args.concurrency), num_requests=args.num_requests, prefix_tokens=args.prefix_tokens,
        suffix_tokens=args.suffix_tokens, max_tokens=args.max_tokens, workloads=tuple(args.workloads),
        mixed=not args.no_mixed, mixed_background=args.mixed_background,
        mixed_background_prompt_tokens=args.mixed_background_prompt_tokens,
        mixed_background_max_tokens=args.mixed_background_max_tokens,
        mixed_baseline_chunks=args.mixed_baseline_chunks, mixed_prefix_tokens=args.mixed_prefix_tokens,
        mixed_suffix_tokens=args.mixed_suffix_tokens, mixed_max_tokens=args.mixed_max_tokens,
        token_logprobs=not args.no_logprobs,
        request_timeout_s=args.request_timeout, level_timeout_s=args.level_timeout, seed=args.bench_seed)


def serve_args_from(args: argparse.Namespace) -> list[str]:
    """`hybridserve serve` arguments for the engine flags that differ from their defaults."""
    probe = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(probe)
    argv = [args.model] if getattr(args, "model", None) else []
    for action in probe._actions:
        if not action.option_strings or action.dest == "model":
            continue
        value = getattr(args, action.dest, action.default)
        if value is not None and value != action.default:
            argv += [action.option_strings[0], str(value)]
    return argv


def run_serve(args: argparse.Namespace) -> int:
    """Handler of `bench serve` (`--compare-offline`: the server against `LLM.generate`)."""
    if args.compare_offline:
        return _run_compare(args)
    result = run_serve_bench(config_from_args(args), url=args.url, serve_args=serve_args_from(args),
                             api_key=args.api_key)
    print(format_serve_report(result))
    if args.json:
        write_json(args.json, result)
        print(f"[bench] figures written to {args.json}", file=sys.stderr)
    return 0


def _run_compare(args: argparse.Namespace) -> int:
    from hybridserve.bench.serve_compare import compare_config_from_args, format_compare_report, run_compare

    result = run_compare(compare_config_from_args(args), engine_config_from_args(args), serve_args_from(args))
    print(format_compare_report(result))
    if args.json:
        write_json(args.json, result)
        print(f"[bench] figures written to {args.json}", file=sys.stderr)
    return 0

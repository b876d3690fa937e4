"""HTTP pieces shared by the server benchmarks: a `hybridserve serve` subprocess, a `/v1/completions`
client (aiohttp or httpx) that records each request's timeline, and a synchronous backend over it.
Requests are greedy with token-id prompts, `ignore_eos` and a fixed `max_tokens`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridserve.bench.common import FIRST_PLAIN_ID, KEEPALIVE_EXPIRY_S, PLAIN_ID_SPAN, random_token_ids
from hybridserve.bench.configs import HTTP_CLIENTS


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; NaN when empty."""
    data = sorted(values)
    if not data:
        return float("nan")
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


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

    def set_usage(self, usage: dict[str, Any]) -> None:
        """Take the token counts of a response's `usage`."""
        self.prompt_tokens = int(usage.get("prompt_tokens", 0))
        self.completion_tokens = int(usage.get("completion_tokens", 0))
        self.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


class PromptSource:
    """Random ordinary token ids, a fresh seed per call, so no two prompts share a block by accident."""

    def __init__(self, seed: int) -> None:
        self._seeds = itertools.count(seed * 1_000_003)

    def fresh(self, num_tokens: int) -> list[int]:
        """`num_tokens` random ids never handed out before by this source."""
        return random_token_ids(num_tokens, next(self._seeds), FIRST_PLAIN_ID + PLAIN_ID_SPAN)


@dataclass
class CompletionClient:
    """Sends the requests to a server over one of `HTTP_CLIENTS` (aiohttp-whole: aiohttp, not
    streamed, so the first "chunk" is the response's end) and records their timelines. `open()`
    (or `async with`) connects and learns the served model's name."""

    url: str
    http_client: str = "httpx"
    connections: int = 8
    token_logprobs: bool = True
    timeout_s: float = 300.0
    api_key: str | None = None
    model: str | None = field(default=None, init=False)
    session: Any = field(default=None, init=False)  # aiohttp.ClientSession or httpx.AsyncClient, imported when used

    def __post_init__(self) -> None:
        if self.http_client not in HTTP_CLIENTS:
            raise ValueError(f"unknown HTTP client {self.http_client!r}; choose from {', '.join(HTTP_CLIENTS)}")
        self.url = self.url.rstrip("/")

    async def open(self) -> CompletionClient:
        """Create the connection pool and read the model's name from `/v1/models` (None if none is listed)."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        if self.http_client == "httpx":
            import httpx

            limits = httpx.Limits(max_connections=self.connections, max_keepalive_connections=self.connections,
                                  keepalive_expiry=KEEPALIVE_EXPIRY_S)
            self.session = httpx.AsyncClient(headers=headers, limits=limits,
                                             timeout=httpx.Timeout(self.timeout_s, connect=10.0))
        else:
            import aiohttp

            connector = aiohttp.TCPConnector(limit=self.connections, keepalive_timeout=KEEPALIVE_EXPIRY_S)
            self.session = aiohttp.ClientSession(connector=connector, headers=headers,
                                                 timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        async with self._request("GET", "/v1/models") as (status, read, _):
            data = json.loads(await read()).get("data") if status == 200 else None
        self.model = data[0]["id"] if data else None
        return self

    async def close(self) -> None:
        """Close the connection pool."""
        await (self.session.aclose() if self.http_client == "httpx" else self.session.close())

    async def __aenter__(self) -> CompletionClient:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def body(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        """Greedy, EOS ignored, streamed with a final usage chunk. With `token_logprobs`, `logprobs: 0`
        makes every token send a chunk even while its text is empty (a partial UTF-8 character)."""
        streamed = self.http_client != "aiohttp-whole"
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                                "stream": streamed}
        if streamed:
            body["stream_options"] = {"include_usage": True}
        if self.model:
            body["model"] = self.model
        if self.token_logprobs:
            body["logprobs"] = 0
        return body

    async def stream(self, prompt: list[int], max_tokens: int, record: RequestRecord | None = None) -> RequestRecord:
        """Send one request and read its response to the end; errors are recorded, not raised
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

    @contextlib.asynccontextmanager
    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None
                       ) -> AsyncIterator[tuple[int, Callable[[], Awaitable[bytes]], AsyncIterator[str]]]:
        """(status, a reader of the whole body, the body's lines) of one request, in either library."""
        if self.http_client == "httpx":
            async with self.session.stream(method, self.url + path, json=body) as resp:
                yield resp.status_code, resp.aread, resp.aiter_lines()
        else:
            async with self.session.request(method, self.url + path, json=body) as resp:
                yield resp.status, resp.read, (line.decode() async for line in resp.content)

    async def _exchange(self, body: dict[str, Any], record: RequestRecord) -> None:
        async with self._request("POST", "/v1/completions", body) as (status, read, lines):
            if status != 200:
                record.error = f"HTTP {status}: {(await read())[:300]!r}"
            elif not body["stream"]:
                data = await read()
                record.chunk_times.append(time.perf_counter())
                record.set_usage(json.loads(data)["usage"])
            else:
                async for line in lines:
                    if not self._on_line(line, record):
                        break

    @staticmethod
    def _on_line(line: str, record: RequestRecord) -> bool:
        """Consume one SSE line; False at `[DONE]` or an error."""
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
        if chunk.get("usage"):
            record.set_usage(chunk["usage"])
        return True


class ServerProcess:
    """A server subprocess on a free loopback port, stopped with SIGTERM on exit: `hybridserve
    serve` with `serve_args`, or another server where a subclass overrides `command`."""

    def __init__(self, serve_args: Sequence[str] = (), *, start_timeout_s: float = 180.0,
                 threads: int | None = None) -> None:
        from hybridserve.distributed.executor import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = self.command(list(serve_args), threads)
        self.start_timeout_s = start_timeout_s
        self._log = tempfile.NamedTemporaryFile(prefix="hybridserve-bench-server-", suffix=".log", delete=False)
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self, serve_args: list[str], threads: int | None) -> list[str]:
        """The server's command line (it listens on 127.0.0.1:`self.port`)."""
        return [sys.executable, "-m", "hybridserve.cli", "serve", *serve_args, "--host", "127.0.0.1",
                "--port", str(self.port), "--log-level", "warning",
                *(["--threads", str(threads)] if threads is not None else [])]

    def __enter__(self) -> ServerProcess:
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT)
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
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
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


class ServerBackend:
    """Synchronous use of a running server's `/v1/completions`: one request at a time, or a batch
    sent at once."""

    def __init__(self, url: str, clients: int, http_client: str = "aiohttp", token_logprobs: bool = False) -> None:
        self.api = CompletionClient(url, http_client, clients + 4, token_logprobs)
        self.url = self.api.url
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.api.open())

    def request(self, prompt: list[int], max_tokens: int) -> RequestRecord:
        """One request's record (RuntimeError when it failed)."""
        record = self.loop.run_until_complete(self.api.stream(prompt, max_tokens))
        if record.error:
            raise RuntimeError(f"request to {self.url} failed: {record.error}")
        return record

    def one(self, prompt: list[int], max_tokens: int) -> tuple[float, float]:
        """(seconds to the first token, seconds to the end) of one request."""
        record = self.request(prompt, max_tokens)
        return record.ttft, record.end - record.start

    def batch(self, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
        """(output tokens, wall seconds) of the prompts sent at once."""
        async def run() -> tuple[int, float]:
            start = time.perf_counter()
            records = await asyncio.gather(*(self.api.stream(p, max_tokens) for p in prompts))
            wall = time.perf_counter() - start
            errors = [r.error for r in records if r.error]
            if errors:
                raise RuntimeError(f"request to {self.url} failed: {errors[0]}")
            return sum(r.completion_tokens for r in records), wall

        return self.loop.run_until_complete(run())

    def close(self) -> None:
        """Close the HTTP client and the loop."""
        self.loop.run_until_complete(self.api.close())
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

"""HTTP pieces shared by the server benchmarks: a `hybridserve serve` subprocess, `/v1/completions`
clients (httpx and aiohttp) that record each request's timeline, and a synchronous backend over them.
Requests are greedy with token-id prompts, `ignore_eos`, a fixed `max_tokens` and
`stream_options.include_usage`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridserve.bench.common import FIRST_PLAIN_ID, KEEPALIVE_EXPIRY_S, PLAIN_ID_SPAN, random_token_ids
from hybridserve.bench.configs import HTTP_CLIENTS

if TYPE_CHECKING:
    import httpx

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


class PromptSource:
    """Random ordinary token ids, a fresh seed per call, so no two prompts share a block by accident."""

    def __init__(self, seed: int) -> None:
        self._seeds = itertools.count(seed * 1_000_003)

    def fresh(self, num_tokens: int) -> list[int]:
        """`num_tokens` random ids never handed out before by this source."""
        return random_token_ids(num_tokens, next(self._seeds), FIRST_PLAIN_ID + PLAIN_ID_SPAN)


class CompletionClient:
    """Streams `/v1/completions` requests and records their timelines."""

    def __init__(self, client: httpx.AsyncClient, model: str | None, token_logprobs: bool = True) -> None:
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
    benchmarks (a client on the server's own cores takes CPU from the engine; aiohttp takes less
    per token than httpx, see the benchmark docs)."""

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


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """A server subprocess on a free loopback port, stopped with SIGTERM on exit: `hybridserve
    serve` with `serve_args`, or another server where a subclass overrides `command`."""

    health_path = "/health"  # polled until it answers 200

    def __init__(self, serve_args: Sequence[str] = (), *, start_timeout_s: float = 180.0,
                 threads: int | None = None) -> None:
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


async def model_name(client: httpx.AsyncClient) -> str | None:
    """The id of the first model the server lists (None when it lists none)."""
    resp = await client.get("/v1/models")
    data = resp.json().get("data") if resp.status_code == 200 else None
    return data[0]["id"] if data else None


class ServerBackend:
    """Synchronous use of a running server's `/v1/completions`: one request at a time, or a batch
    sent at once; over aiohttp (streamed or whole) or httpx (streamed)."""

    def __init__(self, url: str, clients: int, http_client: str = "aiohttp", token_logprobs: bool = False) -> None:
        if http_client not in HTTP_CLIENTS:
            raise ValueError(f"unknown HTTP client {http_client!r}; choose from {', '.join(HTTP_CLIENTS)}")
        self.url = url
        self.http_client = http_client
        self.client: Any = None  # an aiohttp.ClientSession or an httpx.AsyncClient, imported when used
        self.loop = asyncio.new_event_loop()
        self.api = self.loop.run_until_complete(self._connect(clients + 4, token_logprobs))

    async def _connect(self, connections: int, token_logprobs: bool) -> CompletionClient:
        if self.http_client.startswith("aiohttp"):
            import aiohttp

            connector = aiohttp.TCPConnector(limit=connections, keepalive_timeout=KEEPALIVE_EXPIRY_S)
            session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300.0))
            self.client = session
            async with session.get(self.url + "/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]
            kind = AiohttpWholeCompletionClient if self.http_client == "aiohttp-whole" else AiohttpCompletionClient
            return kind(session, self.url, model, token_logprobs)
        import httpx

        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections,
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)
        client = httpx.AsyncClient(base_url=self.url, limits=limits, timeout=httpx.Timeout(300.0))
        self.client = client
        return CompletionClient(client, await model_name(client), token_logprobs)

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
        close = self.client.close() if self.http_client.startswith("aiohttp") else self.client.aclose()
        self.loop.run_until_complete(close)
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

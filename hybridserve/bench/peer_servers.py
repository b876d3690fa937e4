"""The two servers of `hybridserve bench peer` and a synchronous client for each.

`hybridserve serve` runs as in `bench serve` (`ServerProcess`); llama.cpp runs as
`python -m llama_cpp.server` (the `llama-cpp-python` package) on the GGUF file, through
`llama_cpp_launch` when its extra buffer types are off. Requests are
sent one at a time, so at most one server computes at any moment.

The two servers take prompts differently: `hybridserve` gets the token ids; `llama_cpp.server`
accepts only strings, so it gets a text that llama.cpp tokenizes to exactly the same ids (the
bench builds prompts from whole-word tokens and checks every prompt with `/extras/tokenize`
before timing it). EOS is ignored with `ignore_eos` in hybridserve and with a -100 logit bias on
the EOS ids in llama.cpp (its server has no `ignore_eos`).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from hybridserve.bench.llama_cpp_launch import server_argv
from hybridserve.bench.serve_bench import ServerProcess, free_port

EOS_BAN = -100.0  # the most negative bias both servers accept


class LlamaCppServer(ServerProcess):
    """`python -m llama_cpp.server` on a GGUF file, on a free loopback port (SIGTERM on exit)."""

    health_path = "/v1/models"

    def __init__(self, gguf_path: str | Path, *, threads: int, n_ctx: int, n_batch: int = 512,
                 extra_bufts: bool = True, start_timeout_s: float = 180.0) -> None:
        """`extra_bufts=False` keeps llama.cpp's weights out of its AMX / repacked buffer types
        (see `llama_cpp_launch`)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [*server_argv(extra_bufts), "--model", str(gguf_path),
                     "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx),
                     "--n_batch", str(n_batch), "--host", "127.0.0.1", "--port", str(self.port)]
        self.start_timeout_s = start_timeout_s
        self.env = dict(os.environ)
        self._log = tempfile.NamedTemporaryFile(prefix="hybridserve-bench-llamacpp-", suffix=".log", delete=False)
        self.proc = None


@dataclass
class Reply:
    """One timed request: seconds from send to the end (non-streamed) or chunk arrival times."""

    seconds: float
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    chunk_times: list[float] = field(default_factory=list)


class PeerClient:
    """Synchronous `/v1/completions` client of one server (greedy sampling, EOS suppressed)."""

    def __init__(self, name: str, url: str, *, text_prompts: bool, eos_ids: Sequence[int],
                 decode_text: Any = None, timeout_s: float = 600.0) -> None:
        """`text_prompts`: send `decode_text(ids)` instead of the ids (llama_cpp.server)."""
        self.name = name
        self.url = url
        self.text_prompts = text_prompts
        self._decode_text = decode_text
        self._http = httpx.Client(base_url=url, timeout=httpx.Timeout(timeout_s, connect=10.0))
        self._eos = ({"logit_bias": {str(i): EOS_BAN for i in eos_ids}} if text_prompts else {"ignore_eos": True})

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _body(self, ids: list[int], max_tokens: int, stream: bool) -> dict[str, Any]:
        prompt: Any = self._decode_text(ids) if self.text_prompts else ids
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream, **self._eos}
        if stream and not self.text_prompts:
            body["stream_options"] = {"include_usage": True}
        return body

    def check_tokenization(self, ids: list[int]) -> None:
        """Raise if the server would not see exactly `ids` (text prompts only)."""
        if not self.text_prompts:
            return
        resp = self._http.post("/extras/tokenize", json={"input": self._decode_text(ids)})
        resp.raise_for_status()
        got = resp.json()["tokens"]
        if got != ids:
            first = next((i for i, (a, b) in enumerate(zip(got, ids)) if a != b), min(len(got), len(ids)))
            raise RuntimeError(f"{self.name} tokenizes the prompt text differently from the intended ids "
                               f"({len(got)} vs {len(ids)} tokens, first difference at {first})")

    def complete(self, ids: list[int], max_tokens: int = 1) -> Reply:
        """A non-streamed completion; `seconds` is send -> full response (TTFT for 1 token)."""
        body = self._body(ids, max_tokens, stream=False)
        start = time.perf_counter()
        resp = self._http.post("/v1/completions", json=body)
        seconds = time.perf_counter() - start
        if resp.status_code != 200:
            raise RuntimeError(f"{self.name}: HTTP {resp.status_code}: {resp.text[:300]}")
        data = resp.json()
        usage = data.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return Reply(seconds, prompt_tokens=usage.get("prompt_tokens"), cached_tokens=details.get("cached_tokens"),
                     finish_reason=data["choices"][0].get("finish_reason"))

    def stream(self, ids: list[int], max_tokens: int) -> Reply:
        """A streamed completion; records the arrival time of every chunk that carries a choice."""
        reply = Reply(0.0)
        start = time.perf_counter()
        with self._http.stream("POST", "/v1/completions", json=self._body(ids, max_tokens, stream=True)) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"{self.name}: HTTP {resp.status_code}: {resp.read()[:300]!r}")
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                _on_chunk(json.loads(payload), reply)
        reply.seconds = time.perf_counter() - start
        return reply


def _on_chunk(chunk: dict[str, Any], reply: Reply) -> None:
    if "error" in chunk:
        raise RuntimeError(str(chunk["error"]))
    choices = chunk.get("choices") or []
    if choices:
        reply.chunk_times.append(time.perf_counter())
        reply.finish_reason = choices[0].get("finish_reason") or reply.finish_reason
    usage = chunk.get("usage")
    if usage:
        reply.prompt_tokens = usage.get("prompt_tokens")

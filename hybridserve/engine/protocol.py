"""The engine client interface: what the HTTP server (and any asyncio caller) needs from an engine.
Implemented by `EngineCoreClient` (an engine core process) and `AsyncLLMEngine` (a thread)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from hybridserve.sampling_params import RequestOutput, SamplingParams


@runtime_checkable
class RequestOutputStream(Protocol):
    """One request's cumulative `RequestOutput`s, ending with the finished one (intermediate ones
    may be skipped; an engine failure is raised); `finished` turns True once the last was taken."""

    request_id: str
    finished: bool

    def __aiter__(self) -> RequestOutputStream: ...

    async def __anext__(self) -> RequestOutput: ...


@runtime_checkable
class EngineClient(Protocol):
    """An engine as asyncio code sees it: submit, stream, abort, inspect, start and stop. Errors
    are those of `hybridserve.errors`: `InvalidRequestError` (a `ValueError`) for bad input,
    `QueueFullError` when too many requests wait, `EngineDeadError` when the engine is down."""

    tokenizer: Any
    model_config: Any
    max_model_len: int
    max_request_tokens: int

    @property
    def is_running(self) -> bool:
        """True while the engine serves requests."""

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped serving (None while it runs)."""

    @property
    def health_problem(self) -> str | None:
        """Why the health and readiness probes fail now (None: healthy)."""

    @property
    def num_waiting_estimate(self) -> int:
        """Requests submitted and not yet running (approximate)."""

    def start(self) -> None:
        """Start the engine (idempotent)."""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine; requests in flight fail with `EngineDeadError`."""

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          cache_salt: str | None = None) -> RequestOutputStream:
        """Submit a request once the engine accepted it; its outputs come from the stream."""

    def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                 cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit and yield outputs until the request finishes; leaving early aborts it."""

    def abort(self, request_id: str) -> None:
        """Abort a request (any thread; unknown or finished ids are a no-op)."""

    async def call(self, method: str, *args: Any) -> Any:
        """Call the engine's public method (or read its attribute) between steps."""

    async def stats(self) -> dict[str, float]:
        """The engine's `stats()`."""

    async def check_integrity(self) -> None:
        """Run the engine's pool integrity checks (`AssertionError` on a violation)."""

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_tiers: bool = False) -> bool:
        """Forget every cached prefix (`LLMEngine.reset_prefix_cache`; every replica's, behind a
        router); False where requests ran and `reset_running_requests` was not given."""


async def generate_outputs(client: EngineClient, request_id: str, prompt: str | list[int], params: SamplingParams,
                           cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
    """`EngineClient.generate` for any client: submit, yield outputs until the request finishes, and
    abort it when the caller leaves early."""
    stream = await client.add_request(request_id, prompt, params, cache_salt)
    try:
        async for output in stream:
            yield output
    finally:
        if not stream.finished:
            client.abort(request_id)

"""The engine client interface: what the HTTP server (and any asyncio caller) needs from an engine.

Implemented by `core_client.EngineCoreClient` (an engine core process) and `async_engine.AsyncLLMEngine`
(a thread of this process); both raise the errors of `hybridserve.errors`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from hybridserve.sampling_params import RequestOutput, SamplingParams


@runtime_checkable
class RequestOutputStream(Protocol):
    """One request's cumulative `RequestOutput`s, ending with the finished one (an engine failure
    is raised from `__anext__`); `finished` turns True once the last output was taken."""

    request_id: str
    finished: bool

    def __aiter__(self) -> RequestOutputStream:
        """The stream itself."""
        ...

    async def __anext__(self) -> RequestOutput:
        """The newest output (intermediate ones may be skipped: each carries everything so far)."""
        ...


@runtime_checkable
class EngineClient(Protocol):
    """An engine as asyncio code sees it: submit, stream, abort, inspect, start and stop.

    `add_request` raises `InvalidRequestError` (a `ValueError`) for bad input, `QueueFullError`
    when too many requests wait, `EngineDeadError` when the engine is not running.
    """

    tokenizer: Any
    model_config: Any
    max_model_len: int
    max_request_tokens: int

    @property
    def is_running(self) -> bool:
        """True while the engine serves requests."""
        ...

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped serving (None while it runs)."""
        ...

    @property
    def num_waiting_estimate(self) -> int:
        """Requests submitted and not yet running (approximate)."""
        ...

    def start(self) -> None:
        """Start the engine (idempotent)."""
        ...

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine; requests in flight fail with `EngineDeadError`."""
        ...

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          cache_salt: str | None = None) -> RequestOutputStream:
        """Submit a request once the engine accepted it; its outputs come from the stream."""
        ...

    def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                 cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit and yield outputs until the request finishes; leaving early aborts it."""
        ...

    def abort(self, request_id: str) -> None:
        """Abort a request (any thread; unknown or finished ids are a no-op)."""
        ...

    async def call(self, method: str, *args: Any) -> Any:
        """Call the engine's public method `method(*args)` between steps (or read its public
        attribute of that name) and return the result."""
        ...

    async def stats(self) -> dict[str, float]:
        """The engine's `stats()`."""
        ...

    async def check_integrity(self) -> None:
        """Run the engine's pool integrity checks (`AssertionError` on a violation)."""
        ...

"""Asyncio front end of the synchronous `LLMEngine` on a thread of this process: an `EngineClient`
(`hybridserve.engine.protocol`), as `EngineCoreClient` is for an engine core process.

The engine is not thread-safe, so one dedicated thread owns it: between steps it drains a command
queue (add, abort, calls), steps while there is work and sleeps on a condition when idle. Outputs
reach each request's `asyncio.Queue` through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, TypeVar

from hybridserve.engine.protocol import RequestOutputStream
from hybridserve.errors import (
    EngineDeadError,
    EngineOverloadedError,
    EngineStepError,
    InvalidRequestError,
)
from hybridserve.sampling_params import (
    CompletionOutput,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
OutputItem = RequestOutput | BaseException  # what a request's queue carries: an output, or its failure


class SyncEngine(Protocol):
    """What `AsyncLLMEngine` needs from the synchronous engine (`LLMEngine` satisfies it)."""

    tokenizer: Any
    max_model_len: int

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    cache_salt: str | None = None) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def abort_request(self, request_id: str) -> None: ...
    def has_unfinished_requests(self) -> bool: ...
    def stats(self) -> dict[str, float]: ...


@dataclasses.dataclass
class _Sink:
    """Event-loop side of one request: where the engine thread delivers its outputs."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[OutputItem]
    last: RequestOutput | None = None
    final_only: bool = False  # deliver only the finished output (RequestOutputKind.FINAL_ONLY)
    stream_interval: int = 1  # deliver the first output, then one per this many new tokens (and the last)
    delivered_tokens: int = -1  # tokens of the latest delivered output (-1: none yet)

    def due(self, output: RequestOutput) -> bool:
        """Whether an unfinished output is delivered (see `SamplingParams.stream_interval`)."""
        if self.final_only:
            return False
        if self.stream_interval == 1:
            return True
        tokens = max(len(completion.token_ids) for completion in output.outputs)
        if self.delivered_tokens >= 0 and tokens - self.delivered_tokens < self.stream_interval:
            return False
        self.delivered_tokens = tokens
        return True

    def put(self, item: RequestOutput | BaseException) -> None:
        """Deliver from the engine thread; a closed loop (caller gone) is ignored."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass


@dataclasses.dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None
    sink: _Sink
    ack: concurrent.futures.Future[None]


@dataclasses.dataclass
class _Abort:
    request_id: str


@dataclasses.dataclass
class _Call:
    fn: Callable[[Any], Any]
    result: concurrent.futures.Future[Any]


class RequestStream:
    """One request's cumulative `RequestOutput`s, ending with the finished one; a slow consumer
    skips intermediate ones (the newest carries everything); an engine failure is raised."""

    def __init__(self, request_id: str, queue: asyncio.Queue[OutputItem]) -> None:
        self.request_id = request_id
        self._queue = queue
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not self._queue.empty() and isinstance(item, RequestOutput) and not item.finished:
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


class EngineClientBase(abc.ABC):
    """What both front ends (`EngineClient`s) build on their own `add_request`, `abort` and `call`."""

    @abc.abstractmethod
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          cache_salt: str | None = None) -> RequestOutputStream:
        """Submit a request once the engine accepted it."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Abort a request (any thread; unknown or finished ids are a no-op)."""

    @abc.abstractmethod
    async def call(self, method: str, *args: Any) -> Any:
        """Call the engine's public method `method(*args)` between steps."""

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes; leaving early aborts it."""
        stream = await self.add_request(request_id, prompt, params, cache_salt)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(request_id)

    async def stats(self) -> dict[str, float]:
        """The engine's `stats()` dict, read between steps."""
        stats: dict[str, float] = await self.call("stats")
        return stats

    async def check_integrity(self) -> None:
        """Run the engine's pool integrity checks (raises AssertionError on a violation)."""
        await self.call("check_integrity")


class AsyncLLMEngine(EngineClientBase):
    """Runs a synchronous engine on its own thread for asyncio code; beyond `max_waiting_requests`
    queued requests, `add_request` raises `EngineOverloadedError` (503 with Retry-After)."""

    def __init__(self, engine: SyncEngine, *, max_waiting_requests: int | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = int(engine.max_model_len)
        self.model_config = getattr(engine, "model_config", None)
        self.max_request_tokens = max_request_tokens(engine)
        self.max_waiting_requests = max_waiting_requests
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort | _Call] = []
        self._pending_adds = 0
        self._engine_waiting = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._sinks: dict[str, _Sink] = {}  # owned by the engine thread
        self._busy = False  # owned by the engine thread

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> AsyncLLMEngine:
        """Build the sync `LLMEngine` from an `EngineConfig` and wrap it (not started yet)."""
        from hybridserve.engine.engine import LLMEngine

        limit = kwargs.pop("max_waiting_requests", config.scheduler.max_waiting_requests)
        return cls(LLMEngine(config), max_waiting_requests=limit, **kwargs)

    # ----------------------------------------------------------------- lifecycle
    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive and not shutting down."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped serving (a worker died, or it was shut down); None while it runs."""
        reason = getattr(self.engine, "dead_reason", None)
        if reason is not None:
            return str(reason)
        return "engine has been shut down" if self._stopping else None

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        with self._cond:
            if self._stopping:
                raise EngineDeadError(self.dead_reason or "engine has been shut down")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hybridserve-engine", daemon=True)
                self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; in-flight and queued requests fail with `EngineDeadError`."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        stop = getattr(self.engine, "shutdown", None)
        if stop is not None:
            stop()  # tensor-parallel workers

    # ----------------------------------------------------------------- public API
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          cache_salt: str | None = None) -> RequestStream:
        """Submit a request and wait until the engine accepted it (`ValueError` for bad input,
        `EngineOverloadedError` when the queue is full, `EngineDeadError` when not running)."""
        self.start()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[OutputItem] = asyncio.Queue()
        ack: concurrent.futures.Future[None] = concurrent.futures.Future()
        sink = _Sink(loop, queue, final_only=params.output_kind == RequestOutputKind.FINAL_ONLY,
                     stream_interval=params.stream_interval)
        self._submit(_Add(request_id, prompt, params, cache_salt, sink, ack), is_add=True)
        try:
            await asyncio.wrap_future(ack)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return RequestStream(request_id, queue)

    def abort(self, request_id: str) -> None:
        """Abort a request (safe from any thread; unknown or finished ids are a no-op)."""
        try:
            self._submit(_Abort(request_id))
        except EngineDeadError:
            pass

    async def call(self, method: str | Callable[[Any], T], *args: Any) -> Any:
        """On the engine thread, between steps: call the engine's public method `method(*args)`
        (or read its public attribute of that name), as `EngineCoreClient.call` does; in this
        process `method` may also be any function, called as `method(engine)`."""
        self.start()
        fn = method if not isinstance(method, str) else functools.partial(call_engine, method=method, args=list(args))
        result: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._submit(_Call(fn, result))
        return await asyncio.wrap_future(result)

    @property
    def num_waiting_estimate(self) -> int:
        """Requests queued for admission plus those waiting inside the engine (approximate)."""
        with self._cond:
            return self._pending_adds + self._engine_waiting

    # ----------------------------------------------------------------- submission
    def _submit(self, command: _Add | _Abort | _Call, is_add: bool = False) -> None:
        with self._cond:
            if self._stopping or self._thread is None:
                raise EngineDeadError(getattr(self.engine, "dead_reason", None) or "engine is not running")
            if is_add:
                self._check_capacity()
                self._pending_adds += 1
            self._commands.append(command)
            self._cond.notify()

    def _check_capacity(self) -> None:
        limit = self.max_waiting_requests
        if limit is not None and self._pending_adds + self._engine_waiting >= limit:
            raise EngineOverloadedError(f"too many waiting requests (limit {limit}); retry later")

    # ----------------------------------------------------------------- engine thread
    def _run(self) -> None:
        logger.debug("engine loop started")
        while True:
            commands = self._next_commands()
            if commands is None:
                break
            try:
                self._iterate(commands)
            except Exception as exc:
                logger.exception("engine loop iteration failed")
                self._fail_all(EngineStepError(f"engine error: {exc}"))
                time.sleep(0.01)
        self._drain_on_exit()
        logger.debug("engine loop stopped")

    def _next_commands(self) -> list[_Add | _Abort | _Call] | None:
        with self._cond:
            while not self._commands and not self._busy and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            commands, self._commands = self._commands, []
            return commands

    def _iterate(self, commands: list[_Add | _Abort | _Call]) -> None:
        for command in commands:
            self._execute(command)
        if self.engine.has_unfinished_requests():
            self._step()
        self._busy = self.engine.has_unfinished_requests()
        waiting = int(getattr(self.engine, "num_waiting_requests", 0))
        with self._cond:
            self._engine_waiting = waiting

    def _execute(self, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Add):
            self._execute_add(command)
        elif isinstance(command, _Abort):
            self._execute_abort(command.request_id)
        elif command.result.set_running_or_notify_cancel():
            try:
                command.result.set_result(command.fn(self.engine))
            except Exception as exc:  # noqa: BLE001 - handed back to the caller
                command.result.set_exception(exc)

    def _execute_add(self, command: _Add) -> None:
        with self._cond:
            self._pending_adds -= 1
        if not command.ack.set_running_or_notify_cancel():
            return
        try:
            if command.request_id in self._sinks:
                raise ValueError(f"duplicate request id {command.request_id!r}")
            self.engine.add_request(command.request_id, command.prompt, command.params,
                                    cache_salt=command.cache_salt)
        except Exception as exc:  # noqa: BLE001 - handed back to the caller
            command.ack.set_exception(exc)
            return
        self._sinks[command.request_id] = command.sink
        command.ack.set_result(None)

    def _execute_abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink.put(_aborted_output(request_id, sink.last))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing %d in-flight request(s)", len(self._sinks))
            self._fail_all(EngineStepError(f"engine step failed: {exc}"))
            return
        self._deliver(outputs)
        reason = getattr(self.engine, "dead_reason", None)
        if reason is not None:  # e.g. a tensor-parallel worker died
            logger.error("engine stopped: %s", reason)
            with self._cond:
                self._stopping = True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs over with one wake-up per event loop, not one per request.
        `LLMEngine.step` builds fresh output objects (own lists) each step, so they are handed
        over as they are: the engine never mutates them afterwards."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[OutputItem], RequestOutput]]] = {}
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:
                continue
            sink.last = output
            if output.finished:
                del self._sinks[output.request_id]
            elif not sink.due(output):
                continue
            by_loop.setdefault(sink.loop, []).append((sink.queue, output))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed: its callers are gone
                pass

    def _fail_all(self, error: BaseException) -> None:
        sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s failed", request_id)
            sink.put(error)
        try:
            self._busy = self.engine.has_unfinished_requests()
        except Exception:  # noqa: BLE001
            self._busy = False

    def _drain_on_exit(self) -> None:
        with self._cond:
            commands, self._commands = self._commands, []
        error = EngineDeadError("engine has been shut down")
        for command in commands:
            future = command.ack if isinstance(command, _Add) else getattr(command, "result", None)
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(error)
        self._fail_all(error)


def _put_all(items: list[tuple[asyncio.Queue[OutputItem], RequestOutput]]) -> None:
    for queue, output in items:
        queue.put_nowait(output)


def _aborted_output(request_id: str, last: RequestOutput | None) -> RequestOutput:
    if last is not None:
        outputs = [o if o.finish_reason is not None else dataclasses.replace(o, finish_reason="abort")
                   for o in last.outputs]
        return dataclasses.replace(last, outputs=outputs, finished=True)
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[],
                         outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="abort")],
                         finished=True)


def call_engine(engine: Any, method: str, args: list[Any]) -> Any:
    """A utility call: the engine's public method `method` called with `args`, or the value of
    its public attribute of that name when that is not callable (and no arguments are given)."""
    if not method or method.startswith("_"):
        raise InvalidRequestError(f"utility call {method!r}: only public engine methods and attributes "
                                  "can be called")
    target = getattr(engine, method)  # AttributeError, reported to the caller as such
    if callable(target):
        return target(*args)
    if args:
        raise InvalidRequestError(f"utility call {method!r}: an attribute takes no arguments")
    return target


def max_request_tokens(engine: SyncEngine) -> int:
    """Most tokens (prompt + completion) one request can hold: the context length, further
    capped by the KV pool when the engine exposes its size."""
    blocks = getattr(engine, "num_kv_blocks", None)
    cache = getattr(getattr(engine, "config", None), "cache", None)
    block_size = getattr(cache, "block_size", None)
    limit = int(engine.max_model_len)
    if isinstance(blocks, int) and isinstance(block_size, int):
        limit = min(limit, blocks * block_size)
    return limit

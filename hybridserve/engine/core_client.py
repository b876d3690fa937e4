"""The API process's side of an engine core: `CoreClient`, the request bookkeeping both front ends
share (streams, deltas, aborts, errors, utility calls), and `EngineCoreClient`, its client of an
engine core process over one Unix socket (`frames`; the design is in docs/architecture.md,
"Transport"). `AsyncLLMEngine` runs the core on a thread instead."""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import os
import pickle
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from hybridserve.engine import core_messages
from hybridserve.engine.core import SOCKET_DIR_PREFIX, run_engine_core
from hybridserve.engine.detokenizer import IncrementalDetokenizer
from hybridserve.engine.frames import FrameOutbox, FrameReceiver, encode_frame
from hybridserve.engine.protocol import generate_outputs
from hybridserve.engine.threads import child_process_environment
from hybridserve.errors import (
    EngineDeadError,
    EngineOverloadedError,
    EngineStepError,
    InvalidRequestError,
    error_from_kind,
)
from hybridserve.sampling_params import CompletionOutput, RequestOutput, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

POLL_S = 0.2  # how often the reader thread and a starting client look up from the socket
CALL_TIMEOUT_S = 60.0  # default wait for a utility call's answer
MAX_OUTBOX_BYTES = 64 << 20  # default bound of the inputs queued for the core
# `/health` and `/ready` fail when the core has sent nothing (its heartbeats included, every
# core.HEARTBEAT_INTERVAL_S) for this long: a stopped or frozen core process
HEARTBEAT_TIMEOUT_S = 3.0


def _stop_strings(params: SamplingParams) -> list[str]:
    """The request's stop strings as a list."""
    stop = params.stop
    return [] if not stop else [stop] if isinstance(stop, str) else list(stop)


class _TextBuffer:
    """A completion's growing text: appended in pieces, cut back by a stop string at the end, read
    either as the part not handed out yet (`take`) or whole (`value`); each costs the text it
    touches, not the whole text."""

    __slots__ = ("_taken", "_taken_len", "_pending", "_pending_len")

    def __init__(self) -> None:
        self._taken: list[str] = []    # text already handed out by `take`
        self._taken_len = 0
        self._pending: list[str] = []  # text not handed out yet (the new tokens' text, a held-back tail)
        self._pending_len = 0

    def __len__(self) -> int:
        return self._taken_len + self._pending_len

    def append(self, text: str) -> None:
        """Add text at the end."""
        if text:
            self._pending.append(text)
            self._pending_len += len(text)

    def _set_pending(self, text: str) -> None:
        self._pending, self._pending_len = ([text] if text else []), len(text)

    def truncate(self, size: int) -> None:
        """Keep the first `size` characters (a stop string cut the end)."""
        if size >= len(self):
            return
        if size >= self._taken_len:
            self._set_pending("".join(self._pending)[:size - self._taken_len])
            return
        whole = "".join(self._taken)[:size]  # cuts into text already handed out: only cumulative readers
        self._taken, self._taken_len = [whole], len(whole)
        self._set_pending("")

    def take(self, holdback: int) -> str:
        """The text not handed out yet, less its last `holdback` characters, now handed out."""
        pending = "".join(self._pending)
        size = max(0, len(pending) - holdback)
        taken = pending[:size]
        self._set_pending(pending[size:])
        if taken:
            self._taken.append(taken)
            self._taken_len += len(taken)
        return taken

    def value(self) -> str:
        """The whole text."""
        whole = "".join(self._taken) + "".join(self._pending)
        self._taken, self._taken_len = [whole], len(whole)
        self._set_pending("")
        return whole


@dataclasses.dataclass(slots=True)
class _Completion:
    """Accumulated state of one completion on the API side, and how much of it was handed out."""

    index: int
    logprobs: list[dict[int, float]] | None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: _TextBuffer = dataclasses.field(default_factory=_TextBuffer)
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    taken_tokens: int = 0  # token ids (and logprob rows) handed out by `delta`

    def output(self) -> CompletionOutput:
        """Everything so far (copies: a cumulative reader may keep it)."""
        return CompletionOutput(index=self.index, text=self.text.value(), token_ids=list(self.token_ids),
                                cumulative_logprob=self.cumulative_logprob,
                                logprobs=None if self.logprobs is None else list(self.logprobs),
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason)

    def delta(self, holdback: int) -> CompletionOutput:
        """What is new since the previous `delta`: while unfinished, the text's last `holdback`
        characters stay back (a stop string may still cut them)."""
        start, self.taken_tokens = self.taken_tokens, len(self.token_ids)
        text = self.text.take(0 if self.finish_reason is not None else holdback)
        return CompletionOutput(index=self.index, text=text, token_ids=self.token_ids[start:],
                                cumulative_logprob=self.cumulative_logprob,
                                logprobs=None if self.logprobs is None else self.logprobs[start:],
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason)


class RequestStream:
    """Async iterator over one request's `RequestOutput`s (`protocol.RequestOutputStream`), built
    from the core's deltas when read, so a slow consumer coalesces steps; ends with the finished
    output; an engine failure is raised. With `RequestOutputKind.DELTA` each output holds only what
    is new since the previous read (text, token ids, logprob rows), so a read costs what it carries;
    otherwise each is cumulative."""

    def __init__(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                 loop: asyncio.AbstractEventLoop, arrival: float, tokenizer: Any = None) -> None:
        self.request_id = request_id
        self.loop = loop
        self.finished = False
        self._prompt = prompt if isinstance(prompt, str) else None
        self._prompt_ids: list[int] = [] if isinstance(prompt, str) else list(prompt)
        self._prompt_logprobs: list[dict[int, float] | None] | None = None
        self._prompt_logprobs_taken = False  # a DELTA stream hands them out once, in its first output
        self._completions = [_Completion(i, None if params.logprobs is None else []) for i in range(params.n)]
        # the core detokenizes only requests with stop strings: the others' text is made here
        self._detokenizers = None if tokenizer is None or params.stop else \
            [IncrementalDetokenizer(tokenizer, params.skip_special_tokens) for _ in range(params.n)]
        self._deltas = params.output_kind == RequestOutputKind.DELTA
        # the core may cut up to a stop string's length less one of text it already sent
        self._holdback = max((len(stop) for stop in _stop_strings(params)), default=1) - 1
        self._done = False
        self._error: BaseException | None = None
        self._cached = 0
        self._metrics: dict[str, float] = {"arrival_time": arrival}
        self._fresh = False
        self._wakeup = asyncio.Event()

    def apply(self, delta: core_messages.RequestDelta) -> None:
        """Fold one step's delta in (on the event loop)."""
        if self._done:
            return
        if delta.prompt_token_ids is not None:
            self._prompt_ids = delta.prompt_token_ids
            self._prompt_logprobs = delta.prompt_logprobs
        for part in delta.completions:
            comp = self._completions[part.index]
            comp.token_ids += part.token_ids
            if self._detokenizers is None:
                comp.text.truncate(part.text_start)
                comp.text.append(part.text)
            else:
                self._detokenize(comp, part)
            if part.logprobs is not None and comp.logprobs is not None:
                comp.logprobs += part.logprobs
            comp.cumulative_logprob = part.cumulative_logprob
            comp.finish_reason, comp.stop_reason = part.finish_reason, part.stop_reason
        self._cached = delta.num_cached_tokens
        if delta.first_token_time is not None:
            self._metrics["first_token_time"] = delta.first_token_time
        self._done = delta.finished
        self._signal()

    def _detokenize(self, comp: _Completion, part: core_messages.CompletionDelta) -> None:
        """The text of the completion's new tokens: one detokenizer update per delta (with
        `stream_interval`, several tokens; the text equals per-token updates), a flush at the end."""
        assert self._detokenizers is not None
        detokenizer = self._detokenizers[comp.index]
        if part.token_ids:
            comp.text.append(detokenizer.update(comp.token_ids))
        if part.finish_reason is not None:
            comp.text.append(detokenizer.finish(comp.token_ids))

    def fail(self, error: BaseException) -> None:
        """End the stream with an error (on the event loop)."""
        if not self._done:
            self._done, self._error = True, error
            self._signal()

    def abort(self) -> None:
        """End the stream as aborted: unfinished completions get finish_reason "abort"."""
        if self._done:
            return
        for comp in self._completions:
            if comp.finish_reason is None:
                comp.finish_reason = "abort"
        self._done = True
        self._signal()

    def _signal(self) -> None:
        self._fresh = True
        self._wakeup.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self._fresh:
            self._wakeup.clear()
            await self._wakeup.wait()
        self._fresh = False
        if self._error is not None:
            self.finished = True
            raise self._error
        self.finished = self._done
        outputs = [c.delta(self._holdback) if self._deltas else c.output() for c in self._completions]
        prompt_logprobs = self._prompt_logprobs
        if self._deltas and prompt_logprobs is not None:
            prompt_logprobs = None if self._prompt_logprobs_taken else prompt_logprobs
            self._prompt_logprobs_taken = True
        return RequestOutput(request_id=self.request_id, prompt=self._prompt, prompt_token_ids=self._prompt_ids,
                             outputs=outputs, finished=self._done, num_cached_tokens=self._cached,
                             metrics=dict(self._metrics), prompt_logprobs=prompt_logprobs)


class CoreClient(abc.ABC):
    """What both front ends (`EngineClient`s) share: the request, stream and utility-call tables,
    admission, aborts, and the dispatch of the core's output messages into streams and futures.
    A subclass carries the messages to its core (`_encode`, `_send`) and hands back what it sends
    (`_dispatch`, on any thread). A utility call not answered within `call_timeout_s` raises
    `TimeoutError`; a core silent for `heartbeat_timeout_s` is reported by `health_problem`."""

    tokenizer: Any
    model_config: Any
    max_model_len: int
    max_request_tokens: int

    def __init__(self, max_waiting_requests: int | None, call_timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.max_waiting_requests = max_waiting_requests
        self.call_timeout_s = call_timeout_s
        self._lock = threading.Lock()  # guards sending to the core and the tables below
        self._streams: dict[str, RequestStream] = {}
        self._adds: dict[str, concurrent.futures.Future[None]] = {}
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._engine_waiting = 0
        self._pending_adds = 0
        self._dead_reason: str | None = None
        self._stopping = False
        self.heartbeat_timeout_s = HEARTBEAT_TIMEOUT_S
        self._last_heard: float | None = None  # monotonic time of the core's latest message

    @property
    @abc.abstractmethod
    def is_running(self) -> bool:
        """True while the core is up (whether it still answers: `health_problem`)."""

    @abc.abstractmethod
    def start(self) -> None:
        """Start the core (idempotent)."""

    @abc.abstractmethod
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core; requests in flight fail with `EngineDeadError`."""

    @abc.abstractmethod
    def _is_open(self) -> bool:
        """Whether messages can be sent to the core."""

    def _encode(self, message: core_messages.CoreInput) -> Any:
        """The message as `_send` takes it (in this process: the message itself)."""
        return message

    @abc.abstractmethod
    def _send(self, encoded: Any, force: bool = False) -> None:
        """Queue an encoded message for the core without blocking (under `_lock`): over the
        client's bound `EngineOverloadedError`, unless `force`."""

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          cache_salt: str | None = None) -> RequestStream:
        """Submit a request and wait until the core accepted it (the engine's `ValueError` for
        bad input, `EngineOverloadedError` when the queue is full, `EngineDeadError` when down)."""
        self.start()
        # Encoded before a slot is taken; the send is the last step that can fail, so a refusal
        # anywhere leaves nothing behind.
        encoded = self._encode(core_messages.AddRequest(request_id, prompt if isinstance(prompt, str) else list(prompt),
                                          core_messages.params_to_wire(params), cache_salt))
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, prompt, params, loop, time.monotonic(), self.tokenizer)
        ack: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            self._check_alive()
            if request_id in self._streams or request_id in self._adds:
                raise ValueError(f"duplicate request id {request_id!r}")
            limit = self.max_waiting_requests
            if limit is not None and self._pending_adds + self._engine_waiting >= limit:
                raise EngineOverloadedError(f"too many waiting requests (limit {limit}); retry later")
            self._send(encoded)  # the lock holds the answer back until the tables know the request
            self._pending_adds += 1
            self._adds[request_id] = ack
            self._streams[request_id] = stream
        try:
            await asyncio.wrap_future(ack)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (any thread; unknown or finished ids are a no-op); never refused for a
        full queue."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
            if stream is None or not self._is_open() or self._dead_reason is not None:
                return
            with contextlib.suppress(EngineDeadError):  # the core is gone: nothing runs on
                self._send(self._encode(core_messages.AbortRequests([request_id])), force=True)
        _call_in(stream.loop, stream.abort)

    async def call(self, method: str, *args: Any) -> Any:
        """Call the engine's public method `method(*args)` in the core between steps (or read its
        public attribute of that name) and return the result. To a core process, arguments and
        result travel as msgpack: plain values only (a result that cannot is an error)."""
        self.start()
        result: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self._check_alive()
            call_id = next(self._call_ids)
            self._send(self._encode(core_messages.UtilityCall(call_id, method, list(args))))
            self._calls[call_id] = result
        try:
            return await asyncio.wait_for(asyncio.wrap_future(result), self.call_timeout_s)
        except TimeoutError:
            raise TimeoutError(f"the engine did not answer {method!r} within {self.call_timeout_s:g} s") from None
        finally:
            with self._lock:
                self._calls.pop(call_id, None)

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes; leaving early aborts it."""
        async for output in generate_outputs(self, request_id, prompt, params, cache_salt):
            yield output

    async def stats(self) -> dict[str, float]:
        """The engine's `stats()` dict, read between steps."""
        stats: dict[str, float] = await self.call("stats")
        return stats

    async def check_integrity(self) -> None:
        """Run the engine's pool integrity checks (raises AssertionError on a violation)."""
        await self.call("check_integrity")

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_tiers: bool = False) -> bool:
        """`LLMEngine.reset_prefix_cache`, between steps."""
        return bool(await self.call("reset_prefix_cache", reset_running_requests, reset_tiers))

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped serving (None while it runs); `/health` reports it."""
        return self._dead_reason or ("engine has been shut down" if self._stopping else None)

    @property
    def health_problem(self) -> str | None:
        """Why `/health` and `/ready` fail now (None: healthy): the core stopped, or it has sent
        nothing, not even a heartbeat, for `heartbeat_timeout_s` (stopped with SIGSTOP, frozen)."""
        if self.dead_reason is not None:
            return self.dead_reason
        if not self.is_running:
            return "engine is not running"
        last = self._last_heard
        silent_s = 0.0 if last is None else time.monotonic() - last
        if silent_s > self.heartbeat_timeout_s:
            return (f"engine core has sent no heartbeat for {silent_s:.1f} s (limit {self.heartbeat_timeout_s:g} s): "
                    "it is stopped or frozen")
        return None

    def _heard_from_core(self) -> None:
        """Note that the core is alive (any message from it, at start-up its first)."""
        self._last_heard = time.monotonic()

    @property
    def num_waiting_estimate(self) -> int:
        """Requests queued for admission plus those waiting inside the engine (approximate)."""
        return self._pending_adds + self._engine_waiting

    def _check_alive(self) -> None:
        if self._stopping or not self._is_open():
            raise EngineDeadError("engine is not running")
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)

    def _dispatch_guarded(self, messages: list[core_messages.CoreOutput]) -> None:
        try:
            self._dispatch(messages)
        except Exception:
            logger.exception("engine core client: dispatch failed")

    def _dispatch(self, messages: list[Any]) -> None:
        self._heard_from_core()
        items: list[tuple[RequestStream, Any]] = []  # (stream, its delta or error)
        with self._lock:
            for message in messages:
                if isinstance(message, core_messages.StepOutputs):
                    self._engine_waiting = message.num_waiting
                    for delta in message.deltas:
                        stream = (self._streams.pop(delta.request_id, None) if delta.finished
                                  else self._streams.get(delta.request_id))
                        if stream is not None:
                            items.append((stream, delta))
                elif isinstance(message, core_messages.AddResult):
                    self._on_added(message)
                elif isinstance(message, core_messages.UtilityResult):
                    self._on_result(message)
                elif isinstance(message, core_messages.EngineDead):
                    self._dead_reason = message.reason
                elif isinstance(message, core_messages.StepFailed):  # at shutdown the core fails what is left
                    error = (EngineDeadError("engine has been shut down") if self._stopping
                             else EngineStepError(message.message))
                    streams = [self._streams.pop(request_id, None) for request_id in message.request_ids]
                    items += [(stream, error) for stream in streams if stream is not None]
        _deliver(items)

    def _on_added(self, message: core_messages.AddResult) -> None:
        self._pending_adds -= 1
        if message.error_kind is not None:
            self._streams.pop(message.request_id, None)
        _settle(self._adds.pop(message.request_id, None), message)  # None: cancelled, abort() cleaned up

    def _on_result(self, message: core_messages.UtilityResult) -> None:
        _settle(self._calls.pop(message.call_id, None), message, message.value)

    def _mark_dead(self, reason: str) -> None:
        """The core is gone: refuse new requests and fail everything in flight."""
        reason = self._dead_reason or reason
        logger.error("%s; failing in-flight requests", reason)
        self._dead_reason = reason
        self._fail_everything(EngineDeadError(reason))

    def _fail_everything(self, error: EngineDeadError) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
            adds, self._adds = self._adds, {}
            calls, self._calls = self._calls, {}
            self._pending_adds = 0
        for future in [*adds.values(), *calls.values()]:
            if not future.done():
                future.set_exception(error)
        _deliver([(stream, error) for stream in streams.values()])


class EngineCoreClient(CoreClient):
    """Starts an engine core process for an `EngineConfig` and serves it to asyncio code.

    `start()` spawns the process and blocks until the engine is built, raising a build failure
    as the engine raised it. Beyond `max_waiting_requests` queued requests, or `max_outbox_bytes`
    of inputs the core has not read yet, `add_request` raises `EngineOverloadedError`.
    """

    def __init__(self, config: Any, *, max_waiting_requests: int | None = None, start_timeout_s: float = 600.0,
                 max_outbox_bytes: int = MAX_OUTBOX_BYTES, call_timeout_s: float = CALL_TIMEOUT_S) -> None:
        super().__init__(max_waiting_requests, call_timeout_s)
        self.config = config
        self.start_timeout_s = start_timeout_s
        self.max_outbox_bytes = max_outbox_bytes
        self.tokenizer: Any = None
        self.model_config: Any = None
        self.max_model_len = 0
        self.max_request_tokens = 0
        self.startup_stats: dict[str, float] = {}
        self._process: multiprocessing.process.BaseProcess | None = None
        self._socket_dir = ""
        self._sock: socket.socket | None = None  # the one connection to the core, both ways
        self._receiver: FrameReceiver | None = None
        self._outbox: FrameOutbox | None = None
        self._reader: threading.Thread | None = None
        self._home: asyncio.AbstractEventLoop | None = None  # the loop asked to read the outputs
        self._home_reading = False  # True once that loop reads them (the reader thread has ended)
        self._encoder = msgspec.msgpack.Encoder()

    @property
    def is_running(self) -> bool:
        """True while the core process is up and answering."""
        return (self._reader is not None and self._dead_reason is None and not self._stopping
                and self._process is not None and self._process.is_alive())

    @property
    def pid(self) -> int | None:
        """The engine core's process id (None before start)."""
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        """Spawn the core and wait until its engine is built (idempotent; reading on a thread
        again when the loop given to `read_on_loop` has been closed)."""
        if self._stopping:
            raise EngineDeadError("engine has been shut down")
        if self._process is not None:
            self._resume_reader_thread()
            return
        self._socket_dir = tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX)
        address = os.path.join(self._socket_dir, "core")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen(1)
        self._process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name="hybridserve-engine-core",
            args=(self.config, address, os.getpid(), logging.getLogger().getEffectiveLevel()))
        with child_process_environment():  # OpenMP settings before torch loads in the child
            self._process.start()
        deadline = time.monotonic() + self.start_timeout_s
        try:
            self._accept(listener, deadline)
            self._await_ready(deadline)
        except BaseException:
            self._stop_process(graceful=False)
            self._close_socket()
            raise
        finally:
            listener.close()  # one core, one connection
        assert self._sock is not None
        self._outbox = FrameOutbox(self._sock, self.max_outbox_bytes)
        self._start_reader_thread()

    def _accept(self, listener: socket.socket, deadline: float) -> None:
        listener.settimeout(POLL_S)
        while self._sock is None:
            self._check_starting(deadline, exited=False)
            with contextlib.suppress(TimeoutError):
                self._sock, _ = listener.accept()
        self._sock.settimeout(None)  # writes block (on the sender thread); reads never do
        self._receiver = FrameReceiver(self._sock, core_messages.output_decoder())

    def _await_ready(self, deadline: float) -> None:
        """Read the core's first message (`Ready` or `StartupFailed`)."""
        assert self._receiver is not None
        messages: list[core_messages.CoreOutput] | None = []
        while not messages:
            self._check_starting(deadline, exited=messages is None)
            messages = self._receiver.receive_messages(POLL_S)
        message = messages[0]
        if isinstance(message, core_messages.StartupFailed):
            raise error_from_kind(message.kind, message.message)
        if not isinstance(message, core_messages.Ready):
            raise TypeError(f"engine core sent {type(message).__name__} before core_messages.Ready")
        self.tokenizer = pickle.loads(message.tokenizer)  # from our own child process, once
        self.model_config = message.model_config
        self.max_model_len, self.max_request_tokens = message.max_model_len, message.max_request_tokens
        self.startup_stats = message.stats
        self._heard_from_core()
        self._dispatch_guarded(messages[1:])  # no request exists yet: only the waiting count

    def _check_starting(self, deadline: float, exited: bool) -> None:
        """Raise when the starting core has exited (`exited`: it closed its end) or is late."""
        assert self._process is not None
        if exited:
            self._process.join(5)
        if exited or not self._process.is_alive():
            raise RuntimeError(f"engine core exited with code {self._process.exitcode} while starting")
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine core not ready after {self.start_timeout_s:.0f} s")

    def read_on_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the core's outputs on `loop` (the server's event loop, running or about to run)
        instead of on the reader thread, which hands the socket over at its next wake-up (within
        POLL_S). Streams of other loops still get their outputs. `loop` must keep running until
        `shutdown()`; once it is closed, the next request or call starts the reader thread again."""
        self._home = loop

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core process; in-flight requests fail with `EngineDeadError`."""
        if self._stopping:
            return
        self._stopping = True
        if self._process is None:
            return
        with self._lock, contextlib.suppress(EngineDeadError):
            self._send(self._encode(core_messages.Shutdown()), force=True)
        self._stop_process(graceful=True, timeout=timeout)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout)
        self._fail_everything(EngineDeadError("engine has been shut down"))
        self._close_socket()

    def _is_open(self) -> bool:
        return self._outbox is not None and not self._outbox.closed

    def _encode(self, message: core_messages.CoreInput) -> bytearray:
        try:
            return encode_frame(self._encoder, message)
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
            raise InvalidRequestError(f"cannot send {type(message).__name__} to the engine core: {exc}") from exc

    def _send(self, encoded: Any, force: bool = False) -> None:
        if self._outbox is None:
            raise EngineDeadError("engine is not running")
        self._outbox.put(encoded, force)

    def _stop_process(self, graceful: bool, timeout: float = 10.0) -> None:
        process = self._process
        if process is None:
            return
        if graceful:
            process.join(timeout)
        for stop in (process.terminate, process.kill):
            if process.is_alive():
                stop()
                process.join(5)

    def _close_socket(self) -> None:
        """Stop the sender and close the socket: on the loop that reads it, when one does."""
        if self._outbox is not None:
            self._outbox.close()
        sock, home = self._sock, self._home
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a sender blocked on a full socket
            if home is None or not self._home_reading or home.is_closed():
                sock.close()
            elif _running_loop() is home:
                _close_on_loop(home, sock)
            else:
                _call_in(home, _close_on_loop, home, sock)
        shutil.rmtree(self._socket_dir, ignore_errors=True)

    def _start_reader_thread(self) -> None:
        self._reader = threading.Thread(target=self._read_loop, name="hybridserve-core-reader", daemon=True)
        self._reader.start()

    def _resume_reader_thread(self) -> None:
        home = self._home
        if not self._home_reading or home is None or not home.is_closed():
            return
        with self._lock:
            if self._home_reading and not self._stopping:
                self._home, self._home_reading = None, False
                self._start_reader_thread()

    def _read_loop(self) -> None:
        """The reader thread: dispatch the core's messages until it is gone, the client stops, or
        the loop given to `read_on_loop` takes over."""
        while not self._stopping:
            home = self._home
            if home is not None:
                try:
                    home.call_soon_threadsafe(self._read_on_home, home)
                    return
                except RuntimeError:  # that loop is closed
                    self._home = None
            if not self._receive(POLL_S):
                return

    def _read_on_home(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._stopping or self._receiver is None:
            return
        self._home_reading = True
        loop.add_reader(self._receiver.fileno(), self._read_ready, loop)

    def _read_ready(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the home loop: the socket is readable."""
        if not self._receive(0) and self._receiver is not None:
            loop.remove_reader(self._receiver.fileno())

    def _receive(self, timeout: float) -> bool:
        """Read (waiting up to `timeout`) and dispatch the core's messages; False once it is gone."""
        assert self._receiver is not None
        try:
            messages = self._receiver.receive_messages(timeout)
        except OSError:
            messages = None
        if messages:
            self._dispatch_guarded(messages)
            return True
        process = self._process
        alive = process is not None and process.is_alive()
        if messages is not None and alive:
            return True
        if not self._stopping:  # the core closes its end only on its way out
            if process is not None and alive and timeout > 0:
                process.join(5)  # for the exit code in the error
            self._core_died()
        return False

    def _core_died(self) -> None:
        code = self._process.exitcode if self._process is not None else None
        detail = "" if code is None else f" (exit code {code})"
        self._mark_dead(f"engine core process died{detail}")


def _close_on_loop(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    loop.remove_reader(sock.fileno())
    sock.close()


def _settle(future: concurrent.futures.Future[Any] | None, answer: Any, value: Any = None) -> None:
    """Resolve a waiting future with `value`, or with the error the core's answer names."""
    if future is None or future.done():
        return
    if answer.error_kind is None:
        future.set_result(value)
    else:
        future.set_exception(error_from_kind(answer.error_kind, answer.message))


def _deliver(items: list[tuple[RequestStream, Any]]) -> None:
    """Hand each stream its delta or error on its own loop: at once on the running loop, else
    in one `call_soon_threadsafe` per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    running = _running_loop()
    for loop, loop_items in by_loop.items():
        if loop is running:  # read on that loop (`read_on_loop`)
            _apply_all(loop_items)
        else:
            _call_in(loop, _apply_all, loop_items)


def _apply_all(items: list[tuple[RequestStream, Any]]) -> None:
    """On an event loop: fold a step's deltas (or errors) into their streams."""
    for stream, item in items:
        if isinstance(item, BaseException):
            stream.fail(item)
        else:
            stream.apply(item)


def _call_in(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """Schedule `fn(*args)` on `loop`; a closed loop (its caller is gone) is ignored."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None

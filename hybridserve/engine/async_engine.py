"""`AsyncLLMEngine`: the engine on a thread of this process, an `EngineClient` as `EngineCoreClient`
is for an engine core process. The thread runs the same `EngineCore` loop, fed by an in-process
queue; its output messages go straight to the shared `CoreClient` bookkeeping."""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

from hybridserve.engine.core import EngineCore, max_request_tokens
from hybridserve.engine.core_client import CALL_TIMEOUT_S, CoreClient
from hybridserve.engine.core_messages import CoreInput, CoreOutput, Shutdown
from hybridserve.errors import EngineDeadError

logger = logging.getLogger(__name__)


class QueueInputs:
    """The core's inputs in this process: a queue that the client fills and the core drains."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: collections.deque[CoreInput] = collections.deque()

    def put(self, message: CoreInput) -> None:
        """Queue one message and wake the core."""
        with self._cond:
            self._queue.append(message)
            self._cond.notify()

    def poll(self, timeout_ms: int) -> int:
        """Wait up to `timeout_ms` for a message; how many are waiting."""
        with self._cond:
            if not self._queue:
                self._cond.wait(timeout_ms / 1000)
            return len(self._queue)

    def receive(self) -> CoreInput | None:
        """The next waiting message (None: none is)."""
        with self._cond:
            return self._queue.popleft() if self._queue else None


class AsyncLLMEngine(CoreClient):
    """Runs a synchronous engine (an `LLMEngine`) in an `EngineCore` loop on its own thread for
    asyncio code; beyond `max_waiting_requests` queued requests, `add_request` raises
    `EngineOverloadedError` (503 with Retry-After)."""

    def __init__(self, engine: Any, *, max_waiting_requests: int | None = None,
                 call_timeout_s: float = CALL_TIMEOUT_S) -> None:
        super().__init__(max_waiting_requests, call_timeout_s)
        self.engine = engine
        engine.detokenize_all_requests = False  # streams make the text, as for a core process
        self.tokenizer = engine.tokenizer
        self.max_model_len = int(engine.max_model_len)
        self.model_config = getattr(engine, "model_config", None)
        self.max_request_tokens = max_request_tokens(engine)
        self._inputs = QueueInputs()
        self._thread: threading.Thread | None = None

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive and serving."""
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and self._dead_reason is None)

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        with self._lock:
            if self._stopping:
                raise EngineDeadError(self.dead_reason or "engine has been shut down")
            if self._thread is None:
                self._heard_from_core()
                self._thread = threading.Thread(target=self._run, name="hybridserve-engine", daemon=True)
                self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; in-flight and queued requests fail with `EngineDeadError`."""
        with self._lock:
            self._stopping = True
            self._inputs.put(Shutdown())
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._fail_everything(EngineDeadError("engine has been shut down"))
        stop = getattr(self.engine, "shutdown", None)
        if stop is not None:
            stop()  # tensor-parallel workers

    def send_message(self, message: CoreOutput) -> None:
        """The core's `MessageSink`: on the engine thread, into the streams and futures."""
        self._dispatch_guarded([message])

    def _is_open(self) -> bool:
        return self._thread is not None

    def _send(self, encoded: Any, force: bool = False) -> None:
        self._inputs.put(encoded)

    def _run(self) -> None:
        reason = "engine has been shut down"
        try:
            EngineCore(self.engine, self._inputs, self, parent_pid=None).run()
        except Exception as exc:  # the loop itself failed (a step's failure is handled inside it)
            logger.exception("engine loop failed")
            reason = f"engine loop failed: {exc}"
        if self._stopping:
            self._fail_everything(EngineDeadError(reason))
        else:
            self._mark_dead(self._dead_reason or reason)

"""The engine core: `LLMEngine`'s busy loop (`EngineCore`), in its own process (`run_engine_core`,
spawned by `EngineCoreClient`; inputs and outputs are frames on one Unix socket) or on a thread
(`AsyncLLMEngine`, fed by an in-process queue): handle the inputs, step while there is work, send
each step's incremental outputs. The process exits when the socket closes or its parent changes."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import shutil
import signal
import socket
import threading
import time
from collections import deque
from typing import Any, Protocol

from hybridserve.engine import core_messages
from hybridserve.engine.frames import FrameReceiver, FrameSender
from hybridserve.engine.memory import freeze_startup_heap
from hybridserve.errors import InvalidRequestError, error_kind
from hybridserve.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 1.0
# A burst of concurrent clients reaches the core over a few milliseconds. When an idle core receives
# two or more requests at once, it keeps gathering while each next one follows within BURST_GAP_S
# (BURST_WINDOW_S at most), so the burst is prefilled in one step instead of a first step plus
# latecomers that wait for it. A request that arrives alone is not delayed.
BURST_GAP_S = 0.003
BURST_WINDOW_S = 0.03
BURST_POLL_MS = 1
# A thread of the core sends a `Heartbeat` this often while the loop runs, idle or inside a long
# step; the client judges the core by the time since its last message (core_client.HEARTBEAT_TIMEOUT_S).
HEARTBEAT_INTERVAL_S = 0.5
SOCKET_DIR_PREFIX = "hybridserve-core-"  # the API process's socket directory (tempfile.mkdtemp prefix)


@dataclasses.dataclass(slots=True)
class _Sent:
    """How much of one completion the API process has been told about."""

    tokens: int = 0
    text: str = ""
    logprobs: int = 0

    def delta(self, seq: Any) -> core_messages.CompletionDelta:
        """What is new in `seq` since the last delta (and mark it sent)."""
        ids, text = seq.output_token_ids, seq.output_text
        new_ids, self.tokens = ids[self.tokens:], len(ids)
        if text.startswith(self.text):
            start, new_text = len(self.text), text[len(self.text):]
        else:  # a stop string cut text that was already reported
            start, new_text = 0, text
        self.text = text
        rows = cumulative = None
        if seq.logprobs is not None:
            rows, self.logprobs = seq.logprobs[self.logprobs:], len(seq.logprobs)
            cumulative = seq.cumulative_logprob
        return core_messages.CompletionDelta(seq.index, new_ids, start, new_text, rows, cumulative, seq.finish_reason,
                               seq.stop_reason)


class DeltaTracker:
    """Turns the engine's cumulative per-sequence state into per-step `RequestDelta`s."""

    def __init__(self) -> None:
        self._sent: dict[str, list[_Sent]] = {}

    def unsent_tokens(self, group: Any) -> int | None:
        """The most unsent tokens of any of the group's completions (None: nothing sent yet)."""
        sent = self._sent.get(group.request_id)
        if sent is None:
            return None
        return max(len(seq.output_token_ids) - mark.tokens for seq, mark in zip(group.sequences, sent))

    def forget(self, request_id: str) -> None:
        """Drop what is tracked for an aborted request."""
        self._sent.pop(request_id, None)

    def delta(self, group: Any) -> core_messages.RequestDelta:
        """The delta of a group a step touched; a finished group is forgotten."""
        first = group.first
        sent = self._sent.get(group.request_id)
        prompt_ids = prompt_logprobs = None
        if sent is None:
            sent = self._sent[group.request_id] = [_Sent() for _ in group.sequences]
            prompt_ids, prompt_logprobs = first.prompt_token_ids, first.prompt_logprobs
        completions = [mark.delta(seq) for seq, mark in zip(group.sequences, sent)]
        finished = group.is_finished
        if finished:
            del self._sent[group.request_id]
        first_tokens = [s.first_token_time for s in group.sequences if s.first_token_time is not None]
        return core_messages.RequestDelta(group.request_id, completions, finished, first.num_cached_tokens or 0,
                            min(first_tokens) if first_tokens else None, prompt_ids, prompt_logprobs)


class MessageSink(Protocol):
    """Where the core's output messages go (a `FrameSender` in the core process)."""

    def send_message(self, message: core_messages.CoreOutput) -> None: ...


class CoreInputs(Protocol):
    """Where the core's input messages come from (`SocketInputs` in the core process): `poll`
    waits up to `timeout_ms` and says how many wait; `receive` takes one without waiting."""

    def poll(self, timeout_ms: int) -> int: ...

    def receive(self) -> core_messages.CoreInput | None: ...


class SocketInputs:
    """The core process's inputs: frames on its socket to the API process. When the API process
    closes its end, a `Shutdown` is what comes next."""

    def __init__(self, sock: socket.socket) -> None:
        self._receiver = FrameReceiver(sock, core_messages.input_decoder())
        self._waiting: deque[core_messages.CoreInput] = deque()

    def poll(self, timeout_ms: int) -> int:
        """Wait up to `timeout_ms` for a message; how many are waiting."""
        if not self._waiting:
            try:
                messages = self._receiver.receive_messages(timeout_ms / 1000)
            except OSError:
                messages = None
            self._waiting.extend([core_messages.Shutdown()] if messages is None else messages)
        return len(self._waiting)

    def receive(self) -> core_messages.CoreInput | None:
        """The next message, without waiting (None: none is waiting)."""
        return self._waiting.popleft() if self.poll(0) else None


class EngineCore:
    """The busy loop around one `LLMEngine`, fed by `CoreInputs`; its typed output messages go to
    a `MessageSink`. With a `parent_pid`, it stops when that process is no longer its parent. While
    `run` loops, a thread sends a `Heartbeat` every `heartbeat_interval_s` (None: no heartbeat)."""

    def __init__(self, engine: Any, inputs: CoreInputs, outputs: MessageSink, parent_pid: int | None,
                 heartbeat_interval_s: float | None = HEARTBEAT_INTERVAL_S) -> None:
        self.engine = engine
        self.inputs = inputs
        self.outputs = outputs
        self.parent_pid = parent_pid
        self.tracker = DeltaTracker()
        self._live: set[str] = set()
        # added, but held back until their grammar compiles: their AddResult waits for its outcome
        self._awaiting_grammar: set[str] = set()
        self._refused: set[str] = set()  # grammar failed this step: answered by AddResult, not a delta
        if hasattr(engine, "on_grammar_settled"):
            engine.on_grammar_settled = self._grammar_settled
        self._final_only: set[str] = set()  # requests that want only their final output
        self._intervals: dict[str, int] = {}  # requests sent one output per this many new tokens
        self._sent_waiting = -1  # the waiting count the API process last heard
        self._stopping = False
        self._next_parent_check = 0.0
        self.heartbeat_interval_s = heartbeat_interval_s
        self._send_lock = threading.Lock()  # the loop and the heartbeat thread both send

    def send(self, message: core_messages.CoreOutput) -> None:
        """Send one message to the API process (gone: the core stops); any thread."""
        try:
            with self._send_lock:
                self.outputs.send_message(message)
        except OSError:
            self._stopping = True

    def run(self) -> None:
        """Loop until `Shutdown` or until the parent process is gone, beating meanwhile."""
        loop_ended = threading.Event()
        if self.heartbeat_interval_s is not None:  # a daemon: it may be blocked on a full socket
            threading.Thread(target=self._beat, args=(loop_ended, self.heartbeat_interval_s),
                             name="hybridserve-core-heartbeat", daemon=True).start()
        try:
            while not self._stopping:
                busy = self.engine.has_unfinished_requests()
                self._drain_inputs(block=not busy)
                if self._stopping or self._parent_gone():
                    break
                self._report_waiting()
                if self.engine.has_unfinished_requests():
                    self._step()
            self._fail_all("engine core shut down")
        finally:
            loop_ended.set()

    def _beat(self, loop_ended: threading.Event, interval_s: float) -> None:
        """The heartbeat thread: one `Heartbeat` per interval until the loop ends."""
        while not loop_ended.wait(interval_s) and not self._stopping:
            self.send(core_messages.Heartbeat())

    def _drain_inputs(self, block: bool) -> None:
        """Handle every waiting message (after waiting for one when `block`); from idle, gather a
        burst (see BURST_GAP_S)."""
        if block and not self.inputs.poll(int(PARENT_CHECK_S * 1000)):
            return
        added = self._handle_waiting()
        if not block or added < 2:
            return
        deadline = time.monotonic() + BURST_WINDOW_S
        quiet_since = time.monotonic()
        while not self._stopping and time.monotonic() < deadline and time.monotonic() - quiet_since < BURST_GAP_S:
            if self.inputs.poll(BURST_POLL_MS) and self._handle_waiting():
                quiet_since = time.monotonic()

    def _handle_waiting(self) -> int:
        """Handle the messages already queued; returns how many were new requests."""
        added = 0
        while not self._stopping:
            message = self.inputs.receive()
            if message is None:
                return added
            added += isinstance(message, core_messages.AddRequest)
            self._handle(message)
        return added

    def _handle(self, message: Any) -> None:
        """Handle one input message; when that raises, answer its sender with the error and carry on."""
        try:
            self._handle_unguarded(message)
        except Exception as exc:  # noqa: BLE001 - one message's failure is its sender's alone
            logger.exception("engine core: handling %s failed", type(message).__name__)
            self._answer_failure(message, exc)

    def _answer_failure(self, message: Any, exc: Exception) -> None:
        """Tell a failed message's sender: an add is refused (or, when already accepted, its
        request ends with the error), a utility call raises, and a request whose abort raised is
        ended with an error all the same."""
        if isinstance(message, core_messages.AddRequest) and message.request_id in self._live:
            self._end_with_error([message.request_id], f"adding the request failed: {exc}")
        elif isinstance(message, core_messages.AddRequest):
            self._drop([message.request_id])
            self.send(core_messages.AddResult(message.request_id, error_kind(exc), str(exc)))
        elif isinstance(message, core_messages.UtilityCall):
            self.send(core_messages.UtilityResult(message.call_id, error_kind=error_kind(exc), message=str(exc)))
        elif isinstance(message, core_messages.AbortRequests):
            self._end_with_error(message.request_ids, f"aborting the request failed: {exc}")

    def _end_with_error(self, request_ids: list[str], reason: str) -> None:
        """End these requests after a failure: drop them, and their streams end with the error."""
        self._drop(request_ids)
        self.send(core_messages.StepFailed(list(request_ids), reason))

    def _drop(self, request_ids: list[str]) -> None:
        """Forget these requests here and drop them from the engine (best effort after a failure)."""
        for request_id in request_ids:
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001 - best effort: the engine may keep it
                logger.exception("engine core: dropping %s after a failure failed", request_id)
            self.tracker.forget(request_id)
            self._forget(request_id)

    def _handle_unguarded(self, message: Any) -> None:
        if isinstance(message, core_messages.AddRequest):
            self._add(message)
        elif isinstance(message, core_messages.AbortRequests):
            failed: list[str] = []
            for request_id in message.request_ids:  # each alone: one failure stops no other abort
                try:
                    self._abort(request_id)
                except Exception:  # noqa: BLE001 - ended with an error below
                    logger.exception("engine core: aborting %s failed", request_id)
                    failed.append(request_id)
            if failed:
                self._end_with_error(failed, "aborting the request failed")
        elif isinstance(message, core_messages.UtilityCall):
            self._call(message)
        elif isinstance(message, core_messages.Shutdown):
            self._stopping = True

    def _add(self, message: core_messages.AddRequest) -> None:
        try:
            params = core_messages.params_from_wire(message.params)
            self.engine.add_request(message.request_id, message.prompt, params, cache_salt=message.cache_salt)
        except Exception as exc:  # noqa: BLE001 - handed back to the caller
            self.send(core_messages.AddResult(message.request_id, error_kind(exc), str(exc)))
            return
        if params.output_kind == RequestOutputKind.FINAL_ONLY:
            self._final_only.add(message.request_id)
        elif params.stream_interval > 1:
            self._intervals[message.request_id] = params.stream_interval
        if getattr(self.engine, "awaits_grammar", _never)(message.request_id):
            self._awaiting_grammar.add(message.request_id)  # answered by `_grammar_settled`
            return
        self._live.add(message.request_id)  # live: its sender has been told it is queued
        self.send(core_messages.AddResult(message.request_id))

    def _grammar_settled(self, request_id: str, error: str | None) -> None:
        """The engine's callback when a held-back request's grammar compiled (`error` None: it is
        queued and now live) or failed (refused: its sender gets the error, as for a bad request)."""
        if request_id not in self._awaiting_grammar:
            return
        self._awaiting_grammar.discard(request_id)
        if error is None:
            self._live.add(request_id)
            self.send(core_messages.AddResult(request_id))
            return
        self._forget(request_id)
        self._refused.add(request_id)
        self.send(core_messages.AddResult(request_id, error_kind(ValueError(error)), error))

    def _abort(self, request_id: str) -> None:
        awaiting = request_id in self._awaiting_grammar
        self.engine.abort_request(request_id)
        self.tracker.forget(request_id)
        self._forget(request_id)
        if awaiting:  # its sender still waits for the answer to its add
            self.send(core_messages.AddResult(request_id, error_kind(ValueError()), "aborted"))

    def _forget(self, request_id: str) -> None:
        self._live.discard(request_id)
        self._awaiting_grammar.discard(request_id)
        self._final_only.discard(request_id)
        self._intervals.pop(request_id, None)

    def _call(self, message: core_messages.UtilityCall) -> None:
        try:
            value = call_engine(self.engine, message.method, message.args)
            self.send(core_messages.UtilityResult(message.call_id, value))
        except Exception as exc:  # noqa: BLE001 - handed back to the caller (also a result msgpack cannot hold)
            self.send(core_messages.UtilityResult(message.call_id, error_kind=error_kind(exc), message=str(exc)))

    def _step(self) -> None:
        try:
            groups = self.engine.step_groups()
        except Exception as exc:
            logger.exception("engine step failed; failing %d in-flight request(s)", len(self._live))
            self._fail_all(f"engine step failed: {exc}")
            return
        if self._refused:  # requests whose grammar failed: their sender has its answer already
            groups = [g for g in groups if g.request_id not in self._refused]
            self._refused.clear()
        if not groups:
            return
        if self._final_only or self._intervals:  # their deltas accumulate until they are due
            groups = [g for g in groups if g.is_finished or self._due(g)]
        waiting = self._num_waiting()
        if not groups and waiting == self._sent_waiting:
            return
        deltas = [self.tracker.delta(group) for group in groups]
        for delta in deltas:
            if delta.finished:
                self._forget(delta.request_id)
        self.send(core_messages.StepOutputs(deltas, waiting))
        self._sent_waiting = waiting
        reason = getattr(self.engine, "dead_reason", None)
        if reason is not None:  # its requests have just been ended with an error
            logger.error("engine stopped: %s", reason)
            self.send(core_messages.EngineDead(reason))
            self._stopping = True

    def _num_waiting(self) -> int:
        """The engine's waiting count less the adds still unanswered (the API process counts those)."""
        return int(self.engine.num_waiting_requests) - len(self._awaiting_grammar)

    def _report_waiting(self) -> None:
        """Tell the API process the waiting count when inputs changed it: aborts can empty the
        engine with no step to follow, and the API process admits requests by that count."""
        waiting = self._num_waiting()
        if waiting != self._sent_waiting:
            self.send(core_messages.StepOutputs([], waiting))
            self._sent_waiting = waiting

    def _due(self, group: Any) -> bool:
        """Whether an unfinished group's delta is sent this step: never when final-only; with a
        stream interval, its first token and then every `interval` new tokens."""
        request_id = group.request_id
        if request_id in self._final_only:
            return False
        interval = self._intervals.get(request_id)
        if interval is None:
            return True
        unsent = self.tracker.unsent_tokens(group)
        return unsent is None or unsent >= interval

    def _fail_all(self, message: str) -> None:
        failed = sorted(self._live)
        for request_id in failed:
            try:
                self._abort(request_id)
            except Exception:
                logger.exception("abort of %s failed", request_id)
        if failed:
            self.send(core_messages.StepFailed(failed, message))

    def _parent_gone(self) -> bool:
        if self.parent_pid is None:
            return False
        now = time.monotonic()
        if now < self._next_parent_check:
            return False
        self._next_parent_check = now + PARENT_CHECK_S
        return os.getppid() != self.parent_pid


def _never(_request_id: str) -> bool:
    """`awaits_grammar` of an engine without grammars."""
    return False


def call_engine(engine: Any, method: str, args: list[Any]) -> Any:
    """A utility call: the engine's public method `method(*args)`, or its public attribute."""
    if not method or method.startswith("_"):
        raise InvalidRequestError(f"utility call {method!r}: only public engine methods and attributes "
                                  "can be called")
    target = getattr(engine, method)  # AttributeError, reported to the caller as such
    if callable(target):
        return target(*args)
    if args:
        raise InvalidRequestError(f"utility call {method!r}: an attribute takes no arguments")
    return target


def max_request_tokens(engine: Any) -> int:
    """Most tokens (prompt + completion) one request can hold: the context length, capped by the
    KV pool when the engine exposes its size."""
    blocks = getattr(engine, "num_kv_blocks", None)
    block_size = getattr(getattr(getattr(engine, "config", None), "cache", None), "block_size", None)
    limit = int(engine.max_model_len)
    if isinstance(blocks, int) and isinstance(block_size, int):
        limit = min(limit, blocks * block_size)
    return limit


def ready_message(engine: Any) -> core_messages.Ready:
    """What the client needs to know about a freshly built engine."""
    return core_messages.Ready(engine.model_config, int(engine.max_model_len), max_request_tokens(engine),
                               engine.stats(), pickle.dumps(engine.tokenizer))


def run_engine_core(config: Any, address: str, parent_pid: int, log_level: int = logging.WARNING) -> None:
    """Process entry point: connect to the API process's Unix socket at `address`, build the
    engine, report `Ready` (or `StartupFailed`), then loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent stops us
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    logging.getLogger().setLevel(log_level)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    outputs = FrameSender(sock)
    try:
        from hybridserve.engine.engine import LLMEngine

        try:
            engine = LLMEngine(config)
            engine.detokenize_all_requests = False  # the API process detokenizes (stop strings aside)
            ready = ready_message(engine)
            freeze_startup_heap()
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which decides the exit code
            outputs.send_message(core_messages.StartupFailed(error_kind(exc), str(exc)))
            return
        outputs.send_message(ready)
        try:
            EngineCore(engine, SocketInputs(sock), outputs, parent_pid).run()
        finally:
            engine.shutdown()  # stops tensor-parallel workers, if any
    finally:
        sock.close()
        _remove_orphaned_socket_dir(address, parent_pid)


def _remove_orphaned_socket_dir(address: str, parent_pid: int) -> None:
    """When the API process died without its cleanup, remove the private directory it made for
    the socket (only one named as `EngineCoreClient` names it)."""
    directory = os.path.dirname(address)
    if os.getppid() != parent_pid and os.path.basename(directory).startswith(SOCKET_DIR_PREFIX):
        shutil.rmtree(directory, ignore_errors=True)

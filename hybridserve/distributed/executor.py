"""The controller's side of tensor parallelism: `TensorParallelExecutor` starts the rank processes
and writes each command, pickled once, to every local rank's pipe (under torchrun to rank 0, which
broadcasts it); rank 0 answers. A worker that dies raises `WorkerDiedError` and the others are killed."""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import multiprocessing
import os
import socket
import sys
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any, NamedTuple, NoReturn, cast

from hybridserve.cache.manager import Fork
from hybridserve.distributed.worker import LOCAL_RENDEZVOUS, STORE_SCHEME, worker_main
from hybridserve.engine.executor import StepFailedError, WorkerDiedError, unwrap
from hybridserve.engine.step_plan import StepPlan
from hybridserve.engine.threads import child_process_environment
from hybridserve.engine.worker import PlanResult, RankCapacity, StepReply, WorkerSpec

__all__ = ["CommStats", "StepFailedError", "TensorParallelExecutor", "WorkerDiedError", "free_port"]
logger = logging.getLogger(__name__)
START_TIMEOUT_SECONDS = 600.0
RENDEZVOUS_HOST = "127.0.0.1"
RENDEZVOUS_TIMEOUT = timedelta(seconds=START_TIMEOUT_SECONDS)
STOP_GRACE_SECONDS = 5.0


class CommStats(NamedTuple):
    """Time rank 0 spent in forwards and, within them, in all-reduces (since start)."""

    steps: int
    forward_seconds: float
    comm_seconds: float


def free_port() -> int:
    """A TCP port that was free a moment ago (another process may take it before the caller binds
    it; the tensor-parallel rendezvous does not use this: see `_rendezvous_store`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def main_module_not_reimported() -> Iterator[None]:
    """While a rank process is started: hide where `__main__` came from, so the spawned child does
    not import the caller's script again (as `__mp_main__`). A rank needs nothing from it (its target
    and spec live in hybridserve), and re-running a script's top level there would start another
    engine: `LLM(tensor_parallel_size=2)` then works in a script without an
    `if __name__ == "__main__":` guard, and a guarded script's imports are not repeated per rank."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    hidden: dict[str, Any] = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(hidden)


def _rendezvous_store(specs: list[WorkerSpec]) -> tuple[Any, list[WorkerSpec]]:
    """For locally spawned ranks (`LOCAL_RENDEZVOUS`): a `TCPStore` this process binds on port 0 and
    holds (so no other process can take the port between choosing and binding it), and the specs
    pointing at it; the ranks join it as clients. Other specs (torchrun's `env://`) pass through."""
    if specs[0].init_method != LOCAL_RENDEZVOUS:
        return None, specs
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # only where ranks are spawned

    store = TCPStore(RENDEZVOUS_HOST, 0, None, True, timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False)
    address = f"{STORE_SCHEME}{RENDEZVOUS_HOST}:{store.port}"
    return store, [spec._replace(init_method=address) for spec in specs]


class TensorParallelExecutor:
    """Rank processes that execute every step together; answers come from rank 0."""

    def __init__(self, specs: list[WorkerSpec]) -> None:
        """Start a process per spec (rank 0 first) and wait until each loaded its shard (else WorkerDiedError)."""
        context = multiprocessing.get_context("spawn")
        # held for the executor's life: the ranks' group keeps using it after the rendezvous
        self._store, specs = _rendezvous_store(specs)
        self.world_size = specs[0].world_size
        self.broadcast_commands = specs[0].broadcast_commands
        self.processes: list[Any] = []
        self.conns: list[Connection] = []
        self.dead_reason: str | None = None
        self.steps, self.forward_seconds, self.comm_seconds = 0, 0.0, 0.0
        self._inbox: dict[int, tuple[Any, ...]] = {}  # a message that arrived while waiting on another rank
        self._exit_hook = functools.partial(_shutdown_at_exit, weakref.ref(self))
        atexit.register(self._exit_hook)
        for spec in specs:
            parent, child = context.Pipe()
            process = context.Process(target=worker_main, args=(spec, child, os.getpid()),
                                      name=f"hybridserve-tp{spec.rank}", daemon=False)
            with child_process_environment(), main_module_not_reimported():
                process.start()  # OpenMP settings before torch loads in the child
            child.close()
            self.processes.append(process)
            self.conns.append(parent)
        try:
            capacities = [self._receive(conn, "ready", START_TIMEOUT_SECONDS) for conn in self.conns]
        except BaseException:
            self.shutdown()
            raise
        self.capacity: RankCapacity = capacities[0]

    def execute(self, plan: StepPlan) -> PlanResult:
        """Run a step on every rank; rank 0's sampled tokens (StepFailedError, WorkerDiedError)."""
        reply: StepReply = self._call(("execute", plan))
        self.steps += 1
        self.forward_seconds += reply.forward_seconds
        self.comm_seconds += reply.comm_seconds
        return unwrap(reply)

    def save_state(self, state_slot: int, snapshot_slot: int | None) -> bool:
        """Copy a live slot into a snapshot slot on every rank: True only if every rank saved it."""
        if snapshot_slot is None or self.dead_reason is not None:
            return False  # a dead executor saves nothing
        return bool(self._call(("save", state_slot, snapshot_slot)))

    def fork(self, fork: Fork) -> None:
        """Copy a parent's live state (and partial block) to its forked child on every rank."""
        self._call(("fork", fork))

    def inject_snapshot_fault(self, rank: int, fail: bool = True) -> None:
        """Tests: make snapshot copies on `rank` fail (or work again)."""
        self._call(("fault", rank, fail))

    def comm_stats(self) -> CommStats:
        """Forward and all-reduce time of rank 0 so far."""
        return CommStats(self.steps, self.forward_seconds, self.comm_seconds)

    @property
    def pids(self) -> list[int]:
        """Process ids of the local workers."""
        return [p.pid for p in self.processes]

    def _call(self, command: tuple[Any, ...]) -> Any:
        """Send a command to every rank (rank 0 only when it broadcasts), return rank 0's answer."""
        if self.dead_reason is not None:
            raise WorkerDiedError(self.dead_reason)
        payload = ForkingPickler.dumps(command)
        targets = self.conns[:1] if self.broadcast_commands else self.conns
        for rank, conn in enumerate(targets):
            try:
                conn.send_bytes(payload)
            except (OSError, EOFError) as exc:
                self._die(f"tensor-parallel rank {rank} is gone ({exc})")
        return self._receive(self.conns[0], "ok", None)

    def _receive(self, conn: Connection, kind: str, timeout: float | None) -> Any:
        """The next message of `conn`; a worker that exits, or a start-up error of any rank, stops all."""
        deadline = None if timeout is None else time.monotonic() + timeout
        sentinels = {p.sentinel: p for p in self.processes}
        early = self._inbox.pop(id(conn), None)
        if early is not None:
            return early[1]
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self._die(f"tensor-parallel workers did not answer within {timeout:.0f} s")
            ready = wait([conn, *(c for c in self.conns if c is not conn), *sentinels], timeout=left)
            if conn in ready:
                message = self._recv(conn)
                if message[0] == kind:
                    return message[1]
                self._die(str(message[1]))
            for item in ready:
                if item in sentinels:
                    self._worker_gone(sentinels[item], "exited with code {}")
                message = self._recv(cast(Connection, item))  # another rank: its start-up report or error
                if message[0] == "error":
                    self._die(str(message[1]))
                self._inbox[id(item)] = message

    def _recv(self, conn: Connection) -> tuple[Any, ...]:
        try:
            message: tuple[Any, ...] = conn.recv()
            return message
        except (EOFError, OSError):
            self._worker_gone(self.processes[self.conns.index(conn)], "closed its pipe (exit code {})")

    def _worker_gone(self, process: Any, what: str) -> NoReturn:
        """Reap a worker that is gone (so its exit code is known), then stop them all."""
        process.join(STOP_GRACE_SECONDS)
        self._die(f"tensor-parallel worker {process.name} (pid {process.pid}) " + what.format(process.exitcode))

    def _die(self, reason: str) -> NoReturn:
        self.dead_reason = reason
        logger.error("%s; stopping every worker", reason)
        self.shutdown()
        raise WorkerDiedError(reason)

    def shutdown(self) -> None:
        """Stop every worker: a polite stop, then kill whatever is still running."""
        atexit.unregister(self._exit_hook)
        if self.dead_reason is None:
            self.dead_reason = "the engine was shut down"
            for conn in self.conns[:1] if self.broadcast_commands else self.conns:
                with contextlib.suppress(OSError, EOFError):
                    conn.send(("stop",))
            deadline = time.monotonic() + STOP_GRACE_SECONDS
            for process in self.processes:
                process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(STOP_GRACE_SECONDS)
        for conn in self.conns:
            conn.close()
        self.conns = []
        self._store = None  # the ranks are gone: release the rendezvous port

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # e.g. at interpreter shutdown
            if self.processes and any(p.is_alive() for p in self.processes):
                self.shutdown()


def _shutdown_at_exit(executor: weakref.ref[TensorParallelExecutor]) -> None:
    """Stop workers nobody shut down: non-daemons, multiprocessing's exit handler would wait forever."""
    alive = executor()
    if alive is not None:
        alive.shutdown()

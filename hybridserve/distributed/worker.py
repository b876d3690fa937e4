"""A tensor-parallel rank's process: join the group, build the same `Worker` as TP=1, serve commands
(docs/prefix-cache.md, Processes). Rank 0 samples and answers."""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # exported where distributed is built

from hybridserve.distributed.shm_allreduce import CONTROL, ShmAllReduce
from hybridserve.engine.threads import apply_process_settings
from hybridserve.engine.worker import RankGroup, Worker, WorkerSpec

logger = logging.getLogger(__name__)
COMPUTE_TIMEOUT = timedelta(seconds=120)   # a collective inside a step: ranks are never far apart
CONTROL_TIMEOUT = timedelta(days=7)        # waiting for the next command: the engine may idle for long
PARENT_POLL_SECONDS = 1.0


class TorchRankGroup(RankGroup):
    """The `RankGroup` of a tensor-parallel rank (agreements over the ranks, the model's all-reduce timed)."""

    def __init__(self, device: torch.device) -> None:
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        self.shm = ShmAllReduce.setup(self.control, device, COMPUTE_TIMEOUT.total_seconds())
        self.model_all_reduce = self._timed_all_reduce
        self.all_reduce_name = "shm" if self.shm is not None else dist.get_backend()

    def _timed_all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The forward's all-reduce of row-parallel outputs (shared memory when set up), timed."""
        start = time.perf_counter()
        if self.shm is not None:
            tensor = self.shm.all_reduce(tensor)
        else:
            dist.all_reduce(tensor)
        self.comm_seconds += time.perf_counter() - start
        return tensor

    def all_agree(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        self._control_all_reduce(flag, dist.ReduceOp.MIN)
        return bool(flag.item())

    def any_set(self, flags: list[bool]) -> list[bool]:
        values = torch.tensor(flags, dtype=torch.int32)
        self._control_all_reduce(values, dist.ReduceOp.MAX)
        return [bool(v) for v in values.tolist()]

    def min_and_sum(self, smallest: list[int], summed: list[int]) -> tuple[list[int], list[int]]:
        low, total = torch.tensor(smallest), torch.tensor(summed)
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.control)
        dist.all_reduce(total, group=self.control)
        return [int(v) for v in low.tolist()], [int(v) for v in total.tolist()]

    def _control_all_reduce(self, flags: torch.Tensor, op: Any) -> None:
        """A step's agreement (MIN/MAX of int32 flags), through shared memory when set up, else gloo."""
        if self.shm is not None:
            self.shm.all_reduce(flags, op=op, tag=CONTROL, group=self.control)
        else:
            dist.all_reduce(flags, op=op, group=self.control)

    def close(self) -> None:
        """Release the shared-memory all-reduce (peers still waiting in it fail at once)."""
        if self.shm is not None:
            self.shm.close()


def serve(worker: Worker, conn: Connection | None, broadcast: bool, group: TorchRankGroup) -> None:
    """The command loop: every local rank reads the controller's pipe; under torchrun rank 0 broadcasts."""
    while True:
        box: list[Any] = [None]
        if conn is not None:
            try:
                box[0] = conn.recv()
            except EOFError:  # the controller is gone
                box[0] = ("stop",)
        if broadcast:
            dist.broadcast_object_list(box, src=0, group=group.control)
        command = box[0]
        if command[0] == "stop":
            return
        reply = worker.handle(command)
        if worker.rank == 0 and conn is not None:
            conn.send(("ok", reply))


def _watch_parent(parent_pid: int) -> None:
    """Exit when the process that spawned this worker is gone (no orphan after a crash)."""
    while True:
        time.sleep(PARENT_POLL_SECONDS)
        if os.getppid() != parent_pid:
            os._exit(1)


LOCAL_RENDEZVOUS = "local"
"""The `init_method` of the specs of locally spawned ranks: the executor replaces it with the address
of the rendezvous store it binds (`store://HOST:PORT`) before starting them."""
STORE_SCHEME = "store://"


def _join_group(backend: str, spec: WorkerSpec) -> None:
    """Join the process group: through the controller's already-bound `TCPStore` (`store://HOST:PORT`,
    as a client: no rank binds a port), else through `spec.init_method` (`env://` under torchrun)."""
    if spec.init_method.startswith(STORE_SCHEME):
        host, _, port = spec.init_method.removeprefix(STORE_SCHEME).rpartition(":")
        store = TCPStore(host, int(port), None, False, timeout=COMPUTE_TIMEOUT)
        dist.init_process_group(backend, store=store, rank=spec.rank, world_size=spec.world_size,
                                timeout=COMPUTE_TIMEOUT)
        return
    dist.init_process_group(backend, init_method=spec.init_method, rank=spec.rank,
                            world_size=spec.world_size, timeout=COMPUTE_TIMEOUT)


def worker_main(spec: WorkerSpec, conn: Connection | None, parent_pid: int | None = None) -> None:
    """Entry point of a rank's process: join the group, build the shard, report (or the error), serve."""
    if parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    apply_process_settings(spec.num_threads, torch.device(spec.device).type)
    try:
        backend = "nccl" if spec.device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(torch.device(spec.device))
        _join_group(backend, spec)
        group = TorchRankGroup(torch.device(spec.device))
        worker = Worker(spec, group)
        if conn is not None:
            conn.send(("ready", worker.capacity))
    except Exception as exc:  # noqa: BLE001 - reported to the controller, then the process ends
        if conn is not None:
            conn.send(("error", f"rank {spec.rank} failed to start: {exc}\n{traceback.format_exc()}"))
        raise
    try:
        serve(worker, conn if spec.rank == 0 or not spec.broadcast_commands else None, spec.broadcast_commands,
              group)
    finally:
        group.close()
        if dist.is_initialized():
            dist.destroy_process_group()

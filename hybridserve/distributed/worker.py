"""A tensor-parallel model worker: one process per rank, holding its shard and its physical cache.

Each rank builds the model shape of `sharding.local_config`, reads only its part of every weight,
sizes its own KV pages, live slots and snapshot slots, and then agrees with the other ranks on the
smallest capacity (the logical cache the controller owns must fit on every rank). Every rank
receives the same commands (spawned locally: each over its own pipe from the controller; under
torchrun: rank 0 over its pipe, broadcast to the others), so every rank executes the same step
plan; the forwards all-reduce the row-parallel outputs (through shared memory when every rank
is a CPU process on this host, `shm_allreduce.py`; else gloo or NCCL). Ranks report per-rank
success of restores and snapshot saves, and the results are combined so that a snapshot counts
only when every rank holds it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from hybridserve.cache.state_tensors import GDNStateTensors
from hybridserve.config import EngineConfig, ModelConfig
from hybridserve.distributed.sharding import local_config, read_shard, shard_spec
from hybridserve.distributed.shm_allreduce import CONTROL, ShmAllReduce
from hybridserve.engine.memory_plan import MemoryPlan, PlanInputs, device_memory, plan_memory, profile_forward
from hybridserve.engine.runner import ModelRunner, PlanResult
from hybridserve.engine.scheduler import Fork, blocks_for
from hybridserve.engine.step_plan import StepPlan
from hybridserve.layers.attention import PagedKVCache
from hybridserve.models.builtin import builtin_init_tensor, parameter_shapes, rare_token_ids
from hybridserve.models.loader import load_weights
from hybridserve.models.qwen3_5 import Qwen3_5ForCausalLM

logger = logging.getLogger(__name__)
COMPUTE_TIMEOUT = timedelta(seconds=120)   # a collective inside a step: ranks are never far apart
CONTROL_TIMEOUT = timedelta(days=7)        # waiting for the next command: the engine may idle for long
PARENT_POLL_SECONDS = 1.0


class WorkerSpec(NamedTuple):
    """Everything a rank needs to build its shard (picklable: sent to spawned processes)."""

    rank: int
    world_size: int
    init_method: str           # torch.distributed rendezvous ("env://" under torchrun)
    config: EngineConfig
    model_config: ModelConfig  # the full model's shape
    max_model_len: int
    num_threads: int
    device: str
    dtype: str                 # torch dtype name, e.g. "float32"
    chunk_size: int
    broadcast_commands: bool = False  # commands reach rank 0 only and are broadcast (torchrun); else a pipe each


class RankCapacity(NamedTuple):
    """What a rank reports after loading: its pools (after agreeing on the smallest) and sizes."""

    num_kv_blocks: int
    num_snapshot_slots: int
    weight_bytes: int             # this rank's
    kv_bytes_per_block: int       # summed over the ranks
    bytes_per_snapshot: int       # summed over the ranks
    memory_plan: MemoryPlan       # rank 0's
    all_reduce: str = "gloo"      # the forward's all-reduce: "shm" (same-host CPU ranks), "gloo" or "nccl"


class StepReply(NamedTuple):
    """Rank 0's answer to an execute command (`result` is None when the step failed on all ranks)."""

    result: PlanResult | None
    error: str | None
    comm_seconds: float           # rank 0's time in all-reduces during the forward
    forward_seconds: float


class CommTimer:
    """The all-reduce of row-parallel outputs (shared memory when set up, else torch.distributed on
    `group`), timing how long it takes (communication share)."""

    def __init__(self, group: Any, shm: ShmAllReduce | None = None) -> None:
        self.group = group
        self.shm = shm
        self.seconds = 0.0

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        if self.shm is not None:
            tensor = self.shm.all_reduce(tensor, group=self.group)
        else:
            dist.all_reduce(tensor, group=self.group)
        self.seconds += time.perf_counter() - start
        return tensor


class Worker:
    """One rank: its model shard, its `ModelRunner`, and the command loop."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.rank, self.world_size = spec.rank, spec.world_size
        self.device = torch.device(spec.device)
        self.dtype = getattr(torch, spec.dtype)
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        self.shm = ShmAllReduce.setup(self.control, self.device, COMPUTE_TIMEOUT.total_seconds())
        self.comm = CommTimer(None, self.shm)
        self.local = local_config(spec.model_config, spec.world_size)
        self.fail_snapshots = False
        memory_at_start = device_memory(self.device)
        self.model = Qwen3_5ForCausalLM(self.local, chunk_size=spec.chunk_size, max_positions=spec.max_model_len,
                                        all_reduce=self.comm)
        self._load_weights()
        self.capacity = self._agree_capacity(memory_at_start)
        self.runner = ModelRunner(self.model, num_kv_blocks=self.capacity.num_kv_blocks,
                                  block_size=spec.config.cache.block_size,
                                  num_state_slots=spec.config.scheduler.max_num_seqs,
                                  num_snapshot_slots=self.capacity.num_snapshot_slots, dtype=self.dtype,
                                  device=self.device)

    # -- start-up ------------------------------------------------------------------------------
    def _load_weights(self) -> None:
        model, spec = self.model, self.spec
        model.to(device=self.device, dtype=self.dtype).eval()
        if spec.config.model is None:
            init_builtin_shard(model, spec.model_config, spec.config.seed, self.rank, self.world_size)
        else:
            load_weights(model, spec.config.model, spec.model_config, show_progress=self.rank == 0,
                         rank=self.rank, world_size=self.world_size)
        model.pack(spec.config.quantization)

    def _agree_capacity(self, memory_at_start: Any) -> RankCapacity:
        """Plan this rank's pools, then take the smallest over the ranks (and sum the per-rank sizes)."""
        cfg, cache, sched = self.local, self.spec.config.cache, self.spec.config.scheduler
        kv_per_block = cache.block_size * PagedKVCache.bytes_per_token(
            len(cfg.attention_layer_ids), cfg.num_key_value_heads, cfg.head_dim, self.dtype)
        per_snapshot = GDNStateTensors.bytes_per_slot(cfg, self.dtype)
        weight_bytes = self.model.weight_bytes()
        profile_tokens = min(sched.max_num_batched_tokens, self.spec.max_model_len - 1)
        inputs = PlanInputs(self.device, memory_at_start, weight_bytes, kv_per_block, per_snapshot,
                            blocks_for(self.spec.max_model_len, cache.block_size))
        plan = plan_memory(cache, inputs, lambda: profile_forward(self.model, profile_tokens, cache.block_size,
                                                                  self.dtype, self.device))
        counts = torch.tensor([plan.kv_bytes // kv_per_block, plan.snapshot_bytes // per_snapshot])
        dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=self.control)
        sizes = torch.tensor([kv_per_block, per_snapshot])
        dist.all_reduce(sizes, group=self.control)
        transport = "shm" if self.shm is not None else dist.get_backend()
        return RankCapacity(int(counts[0]), int(counts[1]), weight_bytes, int(sizes[0]), int(sizes[1]), plan,
                            transport)

    # -- commands -------------------------------------------------------------------------------
    def handle(self, command: tuple) -> Any:
        """Run one command on this rank; rank 0's return value goes back to the controller."""
        kind = command[0]
        if kind == "execute":
            return self.execute(command[1])
        if kind == "save":
            return self.all_ranks_agree(self.runner.save_state(command[1], command[2]))
        if kind == "fork":
            fork: Fork = command[1]
            self.runner.fork(fork)
            return True
        if kind == "fault":
            _, rank, fail_snapshots = command
            if rank == self.rank:
                self.set_snapshot_fault(fail_snapshots)
            return True
        raise ValueError(f"unknown worker command {kind!r}")

    def execute(self, plan: StepPlan) -> StepReply:
        """Restore (a hit only if every rank restored), forward, combine failed snapshot copies."""
        error = None
        if plan.restores:
            try:
                self.runner.restore(plan)
            except Exception as exc:  # noqa: BLE001 - reported, and the step is skipped on every rank
                logger.exception("rank %d: restore failed", self.rank)
                error = f"rank {self.rank}: restore failed: {exc}"
            if not self.all_ranks_agree(error is None):
                return StepReply(None, error or "another rank failed to restore; the step is skipped", 0.0, 0.0)
        self.comm.seconds = 0.0
        start = time.perf_counter()
        try:
            result: PlanResult | None = self.runner.execute_plan(plan, restored=True)
        except Exception as exc:  # noqa: BLE001 - every rank fails the same forward, or the engine stops
            logger.exception("rank %d: forward failed", self.rank)
            result, error = None, f"rank {self.rank}: forward failed: {exc}"
        elapsed = time.perf_counter() - start
        failed = self.combine_failed(plan, result.failed_snapshot_slots if result is not None else set(), error)
        if failed is None:
            return StepReply(None, error or "the forward failed on another rank", self.comm.seconds, elapsed)
        assert result is not None
        return StepReply(result._replace(failed_snapshot_slots=failed), None, self.comm.seconds, elapsed)

    def all_ranks_agree(self, ok: bool) -> bool:
        """True only when `ok` holds on every rank."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        self._control_all_reduce(flag, dist.ReduceOp.MIN)
        return bool(flag.item())

    def combine_failed(self, plan: StepPlan, failed: set[int], error: str | None) -> set[int] | None:
        """The snapshot slots of the plan that failed on any rank (None if any rank's forward
        failed): one MAX all-reduce over [forward failed, capture 0 failed, capture 1 failed, ...]."""
        slots = [slot for chunk in plan.chunks for _, slot in chunk.captures]
        flags = torch.tensor([error is not None] + [slot in failed for slot in slots], dtype=torch.int32)
        self._control_all_reduce(flags, dist.ReduceOp.MAX)
        if flags[0]:
            return None
        return {slot for slot, bad in zip(slots, flags[1:].tolist()) if bad}

    def _control_all_reduce(self, flags: torch.Tensor, op: Any) -> None:
        """A step's agreement (MIN/MAX of int32 flags): through shared memory when set up, in the
        same sequence as the forward's all-reduces; else on the gloo control group."""
        if self.shm is not None:
            self.shm.all_reduce(flags, op=op, tag=CONTROL, group=self.control)
        else:
            dist.all_reduce(flags, op=op, group=self.control)

    def close(self) -> None:
        """Release the shared-memory all-reduce (peers still waiting in it fail at once)."""
        if self.shm is not None:
            self.shm.close()

    def set_snapshot_fault(self, fail: bool) -> None:
        """Fault injection for tests: make this rank's snapshot copies raise (restores still work)."""
        store = self.runner.snapshots
        if store is None:
            return
        if fail:
            def broken(*_: Any, **__: Any) -> None:
                raise RuntimeError(f"injected snapshot failure on rank {self.rank}")
            store.write_layer = broken  # type: ignore[method-assign]
            store.copy_slot = broken  # type: ignore[method-assign]
        else:
            store.__dict__.pop("write_layer", None)
            store.__dict__.pop("copy_slot", None)

    def serve(self, conn: Connection | None) -> None:
        """The command loop. Spawned locally, every rank reads the controller's pipe (no collective
        per command); under torchrun rank 0 reads it and broadcasts. Rank 0 answers."""
        while True:
            box: list[Any] = [None]
            if conn is not None:
                try:
                    box[0] = conn.recv()
                except EOFError:  # the controller is gone
                    box[0] = ("stop",)
            if self.spec.broadcast_commands:
                dist.broadcast_object_list(box, src=0, group=self.control)
            command = box[0]
            if command[0] == "stop":
                return
            reply = self.handle(command)
            if self.rank == 0:
                assert conn is not None
                conn.send(("ok", reply))


def init_builtin_shard(model: torch.nn.Module, config: ModelConfig, seed: int, rank: int, world_size: int) -> None:
    """Fill a rank's model with its part of the built-in random weights (one full tensor at a time)."""
    shapes = parameter_shapes(config)
    rare = rare_token_ids()
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = builtin_init_tensor(name, shapes[name], seed, rare_ids=rare)
            param.copy_(read_shard(full, shapes[name], shard_spec(name, config, rank, world_size)))


def _watch_parent(parent_pid: int) -> None:
    """Exit when the process that spawned this worker is gone (no orphan after a crash)."""
    while True:
        time.sleep(PARENT_POLL_SECONDS)
        if os.getppid() != parent_pid:
            os._exit(1)


def worker_main(spec: WorkerSpec, conn: Connection | None, parent_pid: int | None = None) -> None:
    """Entry point of a rank's process: join the group, build the shard, report, serve commands.
    Start-up errors go to the controller over `conn` (when there is one) before the process exits."""
    if parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    torch.set_num_threads(spec.num_threads)
    try:
        backend = "nccl" if spec.device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(torch.device(spec.device))
        dist.init_process_group(backend, init_method=spec.init_method, rank=spec.rank,
                                world_size=spec.world_size, timeout=COMPUTE_TIMEOUT)
        worker = Worker(spec)
        if conn is not None:
            conn.send(("ready", worker.capacity))
    except Exception as exc:  # noqa: BLE001 - reported to the controller, then the process ends
        if conn is not None:
            conn.send(("error", f"rank {spec.rank} failed to start: {exc}\n{traceback.format_exc()}"))
        raise
    try:
        worker.serve(conn if spec.rank == 0 or not spec.broadcast_commands else None)
    finally:
        worker.close()
        if dist.is_initialized():
            dist.destroy_process_group()

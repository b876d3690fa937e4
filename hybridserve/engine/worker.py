"""The model worker of every tensor-parallel size (in the engine's process at TP=1, one process per
rank otherwise; only the `RankGroup` differs): builds its model, plans memory, executes `StepPlan`s."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from hybridserve.cache.manager import Fork, blocks_for
from hybridserve.cache.state_tensors import GDNStateTensors
from hybridserve.config import EngineConfig, ModelConfig
from hybridserve.distributed.sharding import local_config, read_shard, shard_spec
from hybridserve.engine.memory import freed_memory_returned, give_back_freed_memory, prepare_step_heap
from hybridserve.engine.memory_plan import MemoryPlan, PlanInputs, device_memory, plan_memory, profile_forward
from hybridserve.engine.runner import ModelRunner
from hybridserve.engine.sampling import SampledToken, Sampler, score_prompt
from hybridserve.engine.step_plan import StepPlan
from hybridserve.layers import native
from hybridserve.layers.attention import PagedKVCache
from hybridserve.models.builtin import builtin_init_tensor, parameter_shapes, rare_token_ids
from hybridserve.models.loader import load_weights
from hybridserve.models.qwen3_5 import Qwen3_5ForCausalLM

logger = logging.getLogger(__name__)


class WorkerSpec(NamedTuple):
    """Everything a rank needs to build its model (picklable: sent to spawned processes)."""

    rank: int
    world_size: int
    init_method: str           # torch.distributed rendezvous ("env://" under torchrun; unused at TP=1)
    config: EngineConfig
    model_config: ModelConfig  # the full model's shape
    max_model_len: int
    num_threads: int
    device: str
    dtype: str                 # torch dtype name, e.g. "float32"
    chunk_size: int
    broadcast_commands: bool = False  # commands reach rank 0 only and are broadcast (torchrun); else a pipe each


class RankCapacity(NamedTuple):
    """What a worker reports after loading: its pools (after agreeing on the smallest) and sizes."""

    num_kv_blocks: int
    num_snapshot_slots: int
    weight_bytes: int             # this rank's
    kv_bytes_per_block: int       # summed over the ranks
    bytes_per_snapshot: int       # summed over the ranks
    memory_plan: MemoryPlan       # rank 0's
    all_reduce: str = "none"      # the forward's all-reduce: "none" (TP=1), "shm", "gloo" or "nccl"


class PlanResult(NamedTuple):
    """A step's draws per sampling chunk (a token or an error message), failed snapshot slots, prompt logits."""

    draws: list[tuple[int, list[SampledToken | str]]]
    failed_snapshot_slots: set[int]
    prompt_logits: list[tuple[int, torch.Tensor]]
    prompt_logprobs: list[tuple[int, list[dict[int, float]]]] = []  # (plan index, a row per scored position)


class StepReply(NamedTuple):
    """A worker's answer to a plan (`result` is None when the step failed on every rank)."""

    result: PlanResult | None
    error: str | None
    comm_seconds: float           # rank 0's time in all-reduces during the forward
    forward_seconds: float


class RankGroup:
    """How a worker's answers combine with the other ranks'; this base is TP=1's single rank."""

    all_reduce_name: str = "none"
    model_all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    comm_seconds: float = 0.0  # time in the model's all-reduces, reset per step by the worker

    def all_agree(self, ok: bool) -> bool:
        """True only when `ok` holds on every rank."""
        return ok

    def any_set(self, flags: list[bool]) -> list[bool]:
        """Each flag OR-ed over the ranks."""
        return flags

    def min_and_sum(self, smallest: list[int], summed: list[int]) -> tuple[list[int], list[int]]:
        """`smallest` reduced by MIN and `summed` by SUM over the ranks."""
        return smallest, summed


def init_builtin_shard(model: torch.nn.Module, config: ModelConfig, seed: int, rank: int, world_size: int) -> None:
    """Fill a rank's model with its part of the built-in random weights (one full tensor at a time)."""
    shapes, rare = parameter_shapes(config), rare_token_ids()
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = builtin_init_tensor(name, shapes[name], seed, rare_ids=rare)
            param.copy_(read_shard(full, shapes[name], shard_spec(name, config, rank, world_size)))


class Worker:
    """One rank: its model, its `ModelRunner`, its `Sampler`, and the commands it executes."""

    def __init__(self, spec: WorkerSpec, group: RankGroup | None = None) -> None:
        self.spec = spec
        self.rank, self.world_size = spec.rank, spec.world_size
        self.group = group or RankGroup()
        self.device = torch.device(spec.device)
        self.dtype = getattr(torch, spec.dtype)
        self.local = local_config(spec.model_config, spec.world_size)
        memory_at_start = device_memory(self.device)
        with freed_memory_returned() if self.device.type == "cpu" else contextlib.nullcontext():
            self.model = Qwen3_5ForCausalLM(self.local, chunk_size=spec.chunk_size,
                                            max_positions=spec.max_model_len, all_reduce=self.group.model_all_reduce)
            self._load_weights()
        self.capacity = self._agree_capacity(memory_at_start)
        self.runner = ModelRunner(self.model, num_kv_blocks=self.capacity.num_kv_blocks,
                                  block_size=spec.config.cache.block_size,
                                  num_state_slots=spec.config.scheduler.max_num_seqs,
                                  num_snapshot_slots=self.capacity.num_snapshot_slots, dtype=self.dtype,
                                  device=self.device)
        self.sampler = Sampler(spec.config.seed, self.device)
        if self.device.type == "cpu":  # readiness means the kernels are built, not built on first use
            native.prepare_kernels()
            give_back_freed_memory()

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
                            blocks_for(self.spec.max_model_len, cache.block_size), max_num_seqs=sched.max_num_seqs,
                            ranks_per_host=self.world_size if self.device.type == "cpu" else 1)
        plan = plan_memory(cache, inputs, lambda: profile_forward(self.model, profile_tokens, cache.block_size,
                                                                  self.dtype, self.device))
        if self.rank == 0:
            logger.info("hybridserve %s", plan.describe())
        counts, sizes = self.group.min_and_sum([plan.kv_bytes // kv_per_block, plan.snapshot_bytes // per_snapshot],
                                               [kv_per_block, per_snapshot])
        return RankCapacity(counts[0], counts[1], weight_bytes, sizes[0], sizes[1], plan, self.group.all_reduce_name)

    def execute(self, plan: StepPlan) -> StepReply:
        """Restore (only if every rank can), forward, combine failed snapshot copies, sample on rank 0."""
        self.sampler.release(plan.released)
        prepare_step_heap(any(chunk.length > 1 for chunk in plan.chunks))  # in each rank's process: memory.py
        error = None
        if plan.restores:
            try:
                self.runner.restore(plan)
            except Exception as exc:  # noqa: BLE001 - reported, and the step is skipped on every rank
                logger.exception("rank %d: restore failed", self.rank)
                error = f"rank {self.rank}: restore failed: {exc}"
            if not self.group.all_agree(error is None):
                return StepReply(None, error or "another rank failed to restore; the step is skipped", 0.0, 0.0)
        self.group.comm_seconds = 0.0
        start = time.perf_counter()
        forward = None
        try:
            forward = self.runner.execute_plan(plan, restored=True)
        except Exception as exc:  # noqa: BLE001 - every rank fails the same forward, or the engine stops
            logger.exception("rank %d: forward failed", self.rank)
            error = f"rank {self.rank}: forward failed: {exc}"
        elapsed = time.perf_counter() - start
        failed = self._combine_failed(plan, forward.failed_snapshot_slots if forward is not None else set(), error)
        if failed is None or forward is None:
            return StepReply(None, error or "the forward failed on another rank", self.group.comm_seconds, elapsed)
        draws: list[tuple[int, list[SampledToken | str]]] = []
        scored: list[tuple[int, list[dict[int, float]]]] = []
        if self.rank == 0:
            specs = [plan.chunks[index].sampling for index in forward.sample_chunks]
            rows = [row for row, chunk in enumerate(specs) for _ in chunk]
            flat = iter(self.sampler.sample(forward.logits, rows, [s for chunk in specs for s in chunk]))
            draws = [(index, [next(flat) for _ in chunk]) for index, chunk in zip(forward.sample_chunks, specs)]
            scored = [(index, score_prompt(logits, spec)) for index, logits in forward.scored_logits
                      if (spec := plan.chunks[index].prompt_logprobs) is not None]
        return StepReply(PlanResult(draws, failed, forward.prompt_logits, scored), None, self.group.comm_seconds,
                         elapsed)

    def _combine_failed(self, plan: StepPlan, failed: set[int], error: str | None) -> set[int] | None:
        """The plan's snapshot slots that failed on any rank (None if any rank's forward failed)."""
        slots = [slot for chunk in plan.chunks for _, slot in chunk.captures]
        flags = self.group.any_set([error is not None] + [slot in failed for slot in slots])
        if flags[0]:
            return None
        return {slot for slot, bad in zip(slots, flags[1:]) if bad}

    def save_state(self, state_slot: int, snapshot_slot: int | None) -> bool:
        """Copy a live slot into a snapshot slot: True only if every rank saved it."""
        return self.group.all_agree(self.runner.save_state(state_slot, snapshot_slot))

    def fork(self, fork: Fork) -> None:
        """Copy a parent's live state (and partial block) to its forked child."""
        self.runner.fork(fork)

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

    def handle(self, command: tuple[Any, ...]) -> Any:
        """Run one command; rank 0's return value is the answer."""
        kind = command[0]
        if kind == "execute":
            return self.execute(command[1])
        if kind == "save":
            return self.save_state(command[1], command[2])
        if kind == "fork":
            self.fork(command[1])
            return True
        if kind == "fault":
            _, rank, fail_snapshots = command
            if rank == self.rank:
                self.set_snapshot_fault(fail_snapshots)
            return True
        raise ValueError(f"unknown worker command {kind!r}")

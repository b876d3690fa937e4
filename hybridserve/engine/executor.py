"""What the engine asks of its workers (`Executor`: token ids and logprobs come back, never logits):
`InProcessExecutor` holds the TP=1 `Worker`, `distributed.executor.TensorParallelExecutor` one per rank."""

from __future__ import annotations

from typing import Protocol

from hybridserve.cache.manager import Fork
from hybridserve.engine.step_plan import StepPlan
from hybridserve.engine.worker import PlanResult, RankCapacity, StepReply, Worker, WorkerSpec


class StepFailedError(RuntimeError):
    """Every rank failed the same step (a forward or a restore raised): it is reverted, the workers stay usable."""


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker died or the ranks fell out of step; the engine cannot continue."""


class Executor(Protocol):
    """The engine's view of its workers."""

    capacity: RankCapacity

    def execute(self, plan: StepPlan) -> PlanResult:
        """Run one step; StepFailedError to revert it, WorkerDiedError when the workers are gone."""

    def save_state(self, state_slot: int, snapshot_slot: int | None) -> bool:
        """Copy a live slot into a snapshot slot; True only if every rank saved it."""

    def fork(self, fork: Fork) -> None:
        """Copy a parent's live state (and partial block) to its forked child."""

    def shutdown(self) -> None:
        """Stop the workers; the executor cannot run steps afterwards."""


def unwrap(reply: StepReply) -> PlanResult:
    """A step's result, or StepFailedError with the ranks' reason."""
    if reply.result is None:
        raise StepFailedError(reply.error or "the step failed")
    return reply.result


class InProcessExecutor:
    """TP=1: the worker lives in the engine's process and runs each plan directly."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.worker = Worker(spec)
        self.capacity = self.worker.capacity

    def execute(self, plan: StepPlan) -> PlanResult:
        return unwrap(self.worker.execute(plan))

    def save_state(self, state_slot: int, snapshot_slot: int | None) -> bool:
        return self.worker.save_state(state_slot, snapshot_slot)

    def fork(self, fork: Fork) -> None:
        self.worker.fork(fork)

    def shutdown(self) -> None:
        """Nothing to stop: the worker goes with the engine."""

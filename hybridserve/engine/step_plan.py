"""The tensor-free, picklable `StepPlan` of a `SchedulerOutput` that every model rank executes, so
every rank's pages and slots stay in step with the one logical cache the controller owns."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from hybridserve.engine.request import Request
from hybridserve.engine.sampling import PromptLogprobsSpec, SamplingSpec, SequenceKey, prompt_logprobs_spec
from hybridserve.engine.scheduler import SchedulerOutput


class PlanChunk(NamedTuple):
    """Tokens [start, start + length) of one sequence."""

    token_ids: list[int]                 # the chunk's tokens only
    start: int
    block_ids: list[int]
    state_slot: int
    captures: list[tuple[int, int]]      # (boundary in tokens, snapshot slot)
    samples: bool                        # the chunk ends at the sequence's last token: it has a logits row
    keep_prompt_logits: bool
    sampling: tuple[SamplingSpec, ...] = ()  # the draws from its logits row: its own, then forked siblings'
    prompt_logprobs: PromptLogprobsSpec | None = None  # prompt tokens its positions score (prompt_logprobs)

    @property
    def length(self) -> int:
        return len(self.token_ids)


class PlanRestore(NamedTuple):
    """Load a live slot from a snapshot slot (None: zero it), after an optional KV block copy."""

    state_slot: int
    snapshot_slot: int | None
    kv_copy: tuple[int, int] | None


class StepPlan(NamedTuple):
    """One step for every rank: restores first, then the forward over `chunks` (in this order)."""

    chunks: list[PlanChunk]
    restores: list[PlanRestore]
    released: tuple[SequenceKey, ...] = ()  # sequences that ended since the last plan: drop their generators


def plan_step(output: SchedulerOutput, draws: Callable[[Request], tuple[SamplingSpec, ...]] | None = None,
              released: list[SequenceKey] | None = None) -> StepPlan:
    """The plan of a scheduled step, decodes first; `draws(request)`: a sampling chunk's specs."""
    ordered = [c for c in output.chunks if c.length == 1] + [c for c in output.chunks if c.length > 1]
    chunks = []
    for chunk in ordered:
        request = chunk.request
        samples = chunk.start + chunk.length == request.num_tokens
        chunks.append(PlanChunk(
            token_ids=request.token_ids[chunk.start:chunk.start + chunk.length], start=chunk.start,
            block_ids=list(chunk.block_ids), state_slot=chunk.state_slot,
            captures=[(r.num_tokens, r.slot) for r in chunk.captures],  # type: ignore[misc]
            samples=samples, keep_prompt_logits=request.keep_prompt_logits,
            sampling=draws(request) if samples and draws is not None else (),
            prompt_logprobs=prompt_logprobs_spec(request, chunk.start, chunk.length)))
    restores = [PlanRestore(r.state_slot, r.snapshot_slot, r.kv_copy) for r in output.restores]
    return StepPlan(chunks, restores, tuple(released or ()))


def ordered_requests(output: SchedulerOutput) -> list[Request]:
    """The requests of `output` in plan order (decodes first)."""
    return [c.request for c in output.chunks if c.length == 1] + [c.request for c in output.chunks if c.length > 1]

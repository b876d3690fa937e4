"""Model runner: owns the physical tensors (KV pages, live GDN slots, snapshot slots) and runs steps:
a `StepPlan` becomes a `ForwardBatch`, run by the first backend that takes it (the one-call CPU step,
else the model's modules), and new GDN state is committed only when the whole forward succeeded."""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from hybridserve.cache.manager import Fork
from hybridserve.cache.state_tensors import GDNStateTensors
from hybridserve.engine.one_call_step import OneCallStep, one_call_step_supported
from hybridserve.engine.step_plan import PlanChunk, StepPlan
from hybridserve.layers.attention import PagedKVCache
from hybridserve.layers.gdn_triton import enable_triton_gdn
from hybridserve.models.batch import DecodeGroup, ForwardBatch, PrefillChunk, StateWrite, context_slots
from hybridserve.models.qwen3_5 import ForwardContext, Qwen3_5ForCausalLM

logger = logging.getLogger(__name__)


class ForwardResult(NamedTuple):
    """What one rank's forward over a `StepPlan` produced (rows follow plan order)."""

    logits: torch.Tensor              # [R, vocab] float32, one row per chunk with `samples`
    sample_chunks: list[int]          # the plan index of each logits row
    failed_snapshot_slots: set[int]
    prompt_logits: list[tuple[int, torch.Tensor]]  # (plan index, every position's logits)
    scored_logits: list[tuple[int, torch.Tensor]] = []  # (plan index, logits of its prompt_logprobs rows)


class SnapshotWriter:
    """Copies captured state into reserved snapshot slots; a failed copy fails the slot, not the forward."""

    def __init__(self, store: GDNStateTensors) -> None:
        self.store = store
        self.failed: set[int] = set()

    def write(self, layer: int, snapshot_slot: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        if snapshot_slot in self.failed:
            return
        try:
            self.store.write_layer(layer, snapshot_slot, conv, recurrent)
        except Exception:  # noqa: BLE001 - any copy failure only costs the snapshot
            logger.exception("snapshot copy into slot %d failed; the snapshot is aborted", snapshot_slot)
            self.failed.add(snapshot_slot)


class ModelRunner:
    """Executes scheduled steps on one device."""

    def __init__(self, model: Qwen3_5ForCausalLM, *, num_kv_blocks: int, block_size: int, num_state_slots: int,
                 num_snapshot_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        config = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        self.kv_cache = PagedKVCache(len(config.attention_layer_ids), num_kv_blocks, block_size,
                                     config.num_key_value_heads, config.head_dim, dtype, device)
        self.live_states = GDNStateTensors(config, num_state_slots, dtype, device)
        self.snapshots = (GDNStateTensors(config, num_snapshot_slots, dtype, device)
                          if num_snapshot_slots > 0 else None)
        self.one_call_step: OneCallStep | None = None  # built on the first step it could take
        self._one_call_checked = False
        self.triton_gdn = enable_triton_gdn(model, device)  # on CUDA with the `cuda` extra; else logs why

    def restore(self, plan: StepPlan) -> None:
        """Load the plan's admitted live slots (from snapshots, or zeroed for a cold start)."""
        for restore in plan.restores:
            if restore.kv_copy is not None:
                self.kv_cache.copy_block(*restore.kv_copy)
            if restore.snapshot_slot is None:
                self.live_states.reset(restore.state_slot)
            else:
                assert self.snapshots is not None
                self.live_states.copy_slot(restore.state_slot, self.snapshots, restore.snapshot_slot)

    @torch.inference_mode()
    def execute_plan(self, plan: StepPlan, restored: bool = False) -> ForwardResult:
        """Restore (unless `restored`), run the forward over the plan's chunks, commit state."""
        if not restored:
            self.restore(plan)
        batch, sample_chunks, full_rows, scored_rows = self._build_batch(plan.chunks)
        writer = SnapshotWriter(self.snapshots) if self.snapshots is not None else None
        writes: list[StateWrite] = []
        undo: list[StateWrite] = []
        try:
            logits = self.forward(batch, ForwardContext(self.kv_cache, self.live_states, writer, writes, undo))
        except BaseException:
            self._write_states(undo)  # layers that updated live state in place: back to before the step
            raise
        self._write_states(writes)
        failed = writer.failed if writer is not None else set()
        num_sampled = len(sample_chunks)
        prompt_logits = [(index, logits[num_sampled + first:num_sampled + first + count])
                         for index, first, count in full_rows]
        scored_logits = [(index, logits[num_sampled + first:num_sampled + first + count])
                         for index, first, count in scored_rows]
        return ForwardResult(logits[:num_sampled], sample_chunks, failed, prompt_logits, scored_logits)

    def forward(self, batch: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
        """Run the forward on the first backend that takes this batch (see the module docstring)."""
        step = self._one_call_step_for(batch, ctx)
        if step is not None:
            return step.run(batch, ctx)
        logits: torch.Tensor = self.model(batch, ctx)
        return logits

    def _one_call_step_for(self, batch: ForwardBatch, ctx: ForwardContext) -> OneCallStep | None:
        """The one-call step if it takes and fits this batch (support is checked once)."""
        if not OneCallStep.takes(batch):
            return None
        if not self._one_call_checked:
            self._one_call_checked = True
            if one_call_step_supported(self.model, ctx):
                self.one_call_step = OneCallStep(self.model, ctx)
        step = self.one_call_step
        return step if step is not None and step.fits(batch) else None

    @torch.inference_mode()
    def save_state(self, state_slot: int, snapshot_slot: int | None) -> bool:
        """Copy a live GDN slot into a reserved snapshot slot; False (logged) if the copy failed."""
        if self.snapshots is None or snapshot_slot is None:
            return False
        try:
            self.snapshots.copy_slot(snapshot_slot, self.live_states, state_slot)
        except Exception:  # noqa: BLE001 - a failed copy only costs the snapshot
            logger.exception("saving live slot %d into snapshot slot %d failed", state_slot, snapshot_slot)
            return False
        return True

    def fork(self, fork: Fork) -> None:
        """Copy a parent sequence's live GDN state (and partial KV block) to its forked child."""
        self.live_states.copy_slot(fork.dst_state_slot, self.live_states, fork.src_state_slot)
        if fork.src_block is not None and fork.dst_block is not None:
            self.kv_cache.copy_block(fork.src_block, fork.dst_block)

    def _write_states(self, writes: list[StateWrite]) -> None:
        conv_dtype = self.live_states.conv.dtype
        for write in writes:
            conv = write.conv if write.conv.dtype == conv_dtype else write.conv.to(conv_dtype)
            self.live_states.conv[write.layer].index_copy_(0, write.slots, conv)
            self.live_states.recurrent[write.layer].index_copy_(0, write.slots, write.recurrent)

    def _build_batch(self, ordered: list[PlanChunk]
                     ) -> tuple[ForwardBatch, list[int], list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """The forward batch of plan chunks (decodes first), the plan index of each sampled row, and
        (plan index, first row after the sampled rows, count) of the chunks that keep every position's
        logits, then of those whose positions score prompt tokens (`prompt_logprobs`): rows that only
        such chunks add (otherwise the last layer runs for the sampled rows alone)."""
        decodes = [c for c in ordered if c.length == 1]
        prefills = [c for c in ordered if c.length > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        sample_chunks: list[int] = []
        full_rows: list[int] = []
        full_chunks: list[tuple[int, int, int]] = []
        scored: list[tuple[int, int, int]] = []  # (plan index, first input row, count)
        for index, chunk in enumerate(ordered):
            row_end = len(input_ids) + chunk.length
            if chunk.keep_prompt_logits:
                full_chunks.append((index, len(full_rows), chunk.length))
                full_rows.extend(range(row_end - chunk.length, row_end))
            if chunk.prompt_logprobs is not None:
                scored.append((index, row_end - chunk.length + chunk.prompt_logprobs.first,
                               len(chunk.prompt_logprobs.targets)))
            input_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, chunk.start + chunk.length))
            if chunk.samples:
                logit_rows.append(row_end - 1)
                sample_chunks.append(index)
        scored_chunks = []
        for index, first_row, count in scored:
            scored_chunks.append((index, len(full_rows), count))
            full_rows.extend(range(first_row, first_row + count))
        device = self.device
        positions_t = torch.tensor(positions, dtype=torch.long, device=device)
        tables = self._block_tables([c.block_ids for c in ordered])
        if prefills:
            chunk_index = torch.repeat_interleave(torch.arange(len(ordered), device=device),
                                                  torch.tensor([c.length for c in ordered], device=device))
            write_slots = self._slots(tables[chunk_index], positions_t)
        else:  # one token per sequence: cheaper in Python than four tensor ops
            size = self.block_size
            write_slots = torch.tensor([c.block_ids[c.start // size] * size + c.start % size for c in ordered],
                                       dtype=torch.long, device=device)
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=device), positions=positions_t,
            kv_write_slots=write_slots,
            decode=self._decode_group(decodes, tables[: len(decodes)]) if decodes else None,
            prefills=self._prefill_chunks(prefills, tables[len(decodes):], len(decodes)),
            logits_rows=torch.tensor(logit_rows + full_rows, dtype=torch.long, device=device),
            logits_only_last_layer=not full_rows, block_tables=tables)
        return batch, sample_chunks, full_chunks, scored_chunks

    def _block_tables(self, block_lists: list[list[int]]) -> torch.Tensor:
        width = max(len(b) for b in block_lists)
        padded = [b + [0] * (width - len(b)) for b in block_lists]
        return torch.tensor(padded, dtype=torch.long, device=self.device)

    def _slots(self, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat KV slot of each position, given each position's block table row."""
        block = tables.gather(-1, (positions // self.block_size).unsqueeze(-1)).squeeze(-1)
        return block * self.block_size + positions % self.block_size

    def _decode_group(self, decodes: list[PlanChunk], tables: torch.Tensor) -> DecodeGroup:
        lengths = [c.start + 1 for c in decodes]
        captures = [(row, slot) for row, c in enumerate(decodes) for _, slot in c.captures]
        return DecodeGroup(
            state_slots=torch.tensor([c.state_slot for c in decodes], dtype=torch.long, device=self.device),
            block_tables=tables, lengths=torch.tensor(lengths, dtype=torch.long, device=self.device),
            max_length=max(lengths), block_size=self.block_size, captures=captures)

    def _prefill_chunks(self, prefills: list[PlanChunk], tables: torch.Tensor, offset: int
                        ) -> list[PrefillChunk]:
        result = []
        for index, chunk in enumerate(prefills):
            prefix = None
            if chunk.start > 0:
                prefix = context_slots(tables[index:index + 1], self.block_size, chunk.start)[0]
            result.append(PrefillChunk(
                token_offset=offset, length=chunk.length, start_position=chunk.start, state_slot=chunk.state_slot,
                prefix_kv_slots=prefix, captures=list(chunk.captures), emits_logits=chunk.samples))
            offset += chunk.length
        return result

"""What one model forward computes: flat tokens (the decode group's first, one per sequence, then each
prefill chunk's in `prefills` order) plus per-sequence layout, built by the runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch


def context_slots(tables: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """Flat KV slots of positions [0, length) for every row of block `tables` [rows, W] -> [rows, length]."""
    offsets = torch.arange(block_size, device=tables.device)
    return (tables[:, :, None] * block_size + offsets).reshape(tables.shape[0], -1)[:, :length]


@dataclass
class PrefillChunk:
    """One sequence's run of prompt tokens in this forward."""

    token_offset: int                 # first row of this chunk in the flat batch
    length: int
    start_position: int               # absolute position of the first token
    state_slot: int                   # live GDN state slot of the sequence
    prefix_kv_slots: torch.Tensor | None  # flat KV slots of positions [0, start_position), or None
    captures: list[tuple[int, int]] = field(default_factory=list)  # (absolute boundary, snapshot slot)
    emits_logits: bool = False        # its last row is a logits row (the sequence's end was reached)


@dataclass
class DecodeGroup:
    """All decoding sequences of this forward (one token each, rows [0, B) of the batch); the flat KV
    slot matrix of their contexts is derived from `block_tables` on first use."""

    state_slots: torch.Tensor         # [B] live GDN state slots
    block_tables: torch.Tensor        # [B, W] KV block ids of each sequence, padded with 0
    lengths: torch.Tensor             # [B] context length (this token's position + 1)
    max_length: int                   # lengths.max()
    block_size: int
    captures: list[tuple[int, int]] = field(default_factory=list)  # (row, snapshot slot)
    _context_kv_slots: torch.Tensor | None = field(default=None, repr=False)

    @property
    def context_kv_slots(self) -> torch.Tensor:
        """[B, max_length] flat KV slots of each context, padded (see `context_valid`)."""
        if self._context_kv_slots is None:
            self._context_kv_slots = context_slots(self.block_tables, self.block_size, self.max_length)
        return self._context_kv_slots

    @property
    def context_valid(self) -> torch.Tensor:
        """[B, max_length] bool, False on padding."""
        return torch.arange(self.max_length, device=self.lengths.device)[None, :] < self.lengths[:, None]


@dataclass
class ForwardBatch:
    """Inputs of one forward: flat token ids and positions, KV write slots, layout, logit rows."""

    input_ids: torch.Tensor           # [T]
    positions: torch.Tensor           # [T]
    kv_write_slots: torch.Tensor      # [T] flat KV slot each token's key/value goes to
    decode: DecodeGroup | None
    prefills: list[PrefillChunk]
    logits_rows: torch.Tensor         # [R] rows whose logits are needed (ascending)
    logits_only_last_layer: bool = False  # logits rows are sequence ends: trim the last layer to them
    block_tables: torch.Tensor | None = None  # [S, W] KV block ids of every sequence (decodes, then prefills)

    @property
    def num_decode(self) -> int:
        """Rows of the decode group."""
        return 0 if self.decode is None else int(self.decode.state_slots.shape[0])


class StateWrite(NamedTuple):
    """GDN state for some live slots of one layer: new state, written after the forward succeeds,
    or (in `ForwardContext.state_undo`) the state a layer replaced in place, written back if it fails."""

    layer: int
    slots: torch.Tensor      # [n] live slots
    conv: torch.Tensor       # [n, conv_dim, kernel - 1]
    recurrent: torch.Tensor  # [n, Hv, Dk, Dv]

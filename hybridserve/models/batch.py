"""What one model forward computes: a flat batch of tokens plus per-sequence layout.

The scheduler decides which tokens run; the model runner turns that into a `ForwardBatch`.
Tokens are flat: the decode group's tokens first (one per sequence), then each prefill
chunk's tokens contiguously, in `prefills` order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch


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
    """All decoding sequences of this forward (one token each, rows [0, B) of the batch)."""

    state_slots: torch.Tensor         # [B] live GDN state slots
    context_kv_slots: torch.Tensor    # [B, L] flat KV slots of each context, padded
    context_valid: torch.Tensor       # [B, L] bool, False on padding
    captures: list[tuple[int, int]] = field(default_factory=list)  # (row, snapshot slot)


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

    @property
    def num_decode(self) -> int:
        return 0 if self.decode is None else int(self.decode.state_slots.shape[0])


class StateWrite(NamedTuple):
    """GDN state for some live slots of one layer: new state, written after the forward succeeds,
    or (in `ForwardContext.state_undo`) the state a layer replaced in place, written back if it fails."""

    layer: int
    slots: torch.Tensor      # [n] live slots
    conv: torch.Tensor       # [n, conv_dim, kernel - 1]
    recurrent: torch.Tensor  # [n, Hv, Dk, Dv]

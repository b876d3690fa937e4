"""Partial rotary position embedding (the leading `rotary_dim` dims of each head rotate)."""

from __future__ import annotations

import torch
from torch import nn


class PartialRotaryEmbedding(nn.Module):
    """Precomputed cos/sin table indexed by absolute position; rotates the first `rotary_dim`
    channels of each head in the rotate-half layout and passes the rest through."""

    cos_table: torch.Tensor
    sin_table: torch.Tensor

    def __init__(self, head_dim: int, rotary_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos_table", emb.cos(), persistent=False)
        self.register_buffer("sin_table", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for `positions` ([T]) shaped [T, 1, rotary_dim] for broadcasting over heads."""
        return (self.cos_table[positions].to(dtype).unsqueeze(1),
                self.sin_table[positions].to(dtype).unsqueeze(1))

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x ([T, heads, head_dim]) (not `apply`, which would shadow `nn.Module.apply`)."""
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        half = self.rotary_dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = rot * cos + rotated * sin
        return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)

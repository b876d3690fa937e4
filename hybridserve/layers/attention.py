"""Paged KV storage for the full-attention layers and the attention kernels over it.

Keys and values of every attention layer live in one tensor per kind, shaped
[layers, num_blocks * block_size, kv_heads, head_dim]: token slot `block_id * block_size + offset`
holds one token. Which block belongs to which request is decided elsewhere (the block pool);
this module only reads and writes slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class PagedKVCache:
    """Physical KV pages for all full-attention layers."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one token occupies across all attention layers (keys and values)."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values ([T, kv_heads, head_dim]) of T tokens at flat `slots` ([T])."""
        self.keys[layer].index_copy_(0, slots, keys)
        self.values[layer].index_copy_(0, slots, values)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values at flat `slots` (any shape S) -> [*S, kv_heads, head_dim]."""
        return self.keys[layer][slots], self.values[layer][slots]


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_prefix: int,
                      scale: float) -> torch.Tensor:
    """Causal attention of T new queries over `num_prefix` earlier tokens plus themselves.

    q: [T, H, D]; keys/values: [num_prefix + T, KvH, D]. Query i sits at position num_prefix + i.
    """
    num_new = q.shape[0]
    qh, kh, vh = q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
    if num_prefix == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        total = num_prefix + num_new
        key_pos = torch.arange(total, device=q.device)
        query_pos = torch.arange(num_prefix, total, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query per sequence over its padded context.

    q: [B, H, D]; keys/values: [B, L, KvH, D]; valid: [B, L] bool (False = padding).
    """
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True)
    return out.squeeze(2)

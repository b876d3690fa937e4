"""Paged KV storage for the full-attention layers ([layers, num_blocks * block_size, kv_heads,
head_dim] per keys and values; slot `block_id * block_size + offset` holds one token) and the
attention kernels over it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from hybridserve.layers.huge_pages import zeros_touched_as_used


class PagedKVCache:
    """Physical KV pages for all full-attention layers."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.keys = zeros_touched_as_used(shape, dtype, device)
        self.values = zeros_touched_as_used(shape, dtype, device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one token occupies across all attention layers (keys and values)."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values ([T, kv_heads, head_dim]) of T tokens at flat `slots` ([T])."""
        self.keys[layer].index_copy_(0, slots, keys)
        self.values[layer].index_copy_(0, slots, values)

    def copy_block(self, source: int, target: int) -> None:
        """Copy every layer's keys and values of block `source` into block `target`."""
        size = self.block_size
        self.keys[:, target * size:(target + 1) * size] = self.keys[:, source * size:(source + 1) * size]
        self.values[:, target * size:(target + 1) * size] = self.values[:, source * size:(source + 1) * size]

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values at flat `slots` (any shape S) -> [*S, kv_heads, head_dim]."""
        flat = slots.reshape(-1)
        shape = (*slots.shape, *self.keys.shape[2:])
        return (self.keys[layer].index_select(0, flat).view(shape),
                self.values[layer].index_select(0, flat).view(shape))


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_prefix: int,
                      scale: float) -> torch.Tensor:
    """Causal attention of T new queries q [T, H, D] over `num_prefix` earlier tokens plus themselves
    (keys/values [num_prefix + T, KvH, D]): SDPA with `enable_gqa`, the mask aligned lower-right behind
    a prefix; a single query needs no mask (each KV group's G query heads run as G rows against it)."""
    num_new, num_heads, head_dim = q.shape
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, keys, values))
    if num_prefix == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    if num_new > 1:
        mask = causal_lower_right(num_new, num_prefix + num_new)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    num_kv = keys.shape[1]
    rows = q.view(num_kv, num_heads // num_kv, head_dim).unsqueeze(0)
    out = F.scaled_dot_product_attention(rows, kh, vh, scale=scale)
    return out.reshape(1, num_heads, head_dim)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query per sequence over its padded context, each KV group's G query heads as G rows
    against the unexpanded KV head. q: [B, H, D]; keys/values: [B, L, KvH, D]; valid: [B, L] bool."""
    batch, num_heads, head_dim = q.shape
    num_kv = keys.shape[2]
    out = F.scaled_dot_product_attention(
        q.view(batch, num_kv, num_heads // num_kv, head_dim), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(batch, num_heads, head_dim)

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


def _expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., KvH, L, D] -> [..., H, L, D]: repeat each KV head for its query group."""
    groups = num_heads // x.shape[-3]
    return x if groups == 1 else x.repeat_interleave(groups, dim=-3)


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_prefix: int,
                      scale: float) -> torch.Tensor:
    """Causal attention of T new queries over `num_prefix` earlier tokens plus themselves.

    q: [T, H, D]; keys/values: [num_prefix + T, KvH, D]. Query i sits at position num_prefix + i.
    Without a prefix, KV heads are expanded so SDPA takes its fused causal kernel. With one, the
    queries of each KV group are stacked instead ([KvH, G*T, D]) so the long prefix is never copied.
    """
    num_new, num_heads, head_dim = q.shape
    if num_prefix == 0:
        qh = q.transpose(0, 1).unsqueeze(0)
        kh = _expand_kv(keys.transpose(0, 1), num_heads).unsqueeze(0)
        vh = _expand_kv(values.transpose(0, 1), num_heads).unsqueeze(0)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        return out[0].transpose(0, 1)
    num_kv = keys.shape[1]
    groups = num_heads // num_kv
    total = num_prefix + num_new
    mask = None  # a single (last) query sees every key
    if num_new > 1:
        key_pos = torch.arange(total, device=q.device)
        query_pos = torch.arange(num_prefix, total, device=q.device)
        mask = (key_pos[None, :] <= query_pos[:, None]).repeat(groups, 1)
    stacked = q.view(num_new, num_kv, groups, head_dim).permute(1, 2, 0, 3).reshape(num_kv, groups * num_new, -1)
    out = F.scaled_dot_product_attention(stacked.unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                                         values.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale)
    return out.view(num_kv, groups, num_new, head_dim).permute(2, 0, 1, 3).reshape(num_new, num_heads, head_dim)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query per sequence over its padded context; the G query heads of a KV group are
    attended as G rows against the unexpanded KV head.

    q: [B, H, D]; keys/values: [B, L, KvH, D]; valid: [B, L] bool (False = padding).
    """
    batch, num_heads, head_dim = q.shape
    num_kv = keys.shape[2]
    out = F.scaled_dot_product_attention(
        q.view(batch, num_kv, num_heads // num_kv, head_dim), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(batch, num_heads, head_dim)

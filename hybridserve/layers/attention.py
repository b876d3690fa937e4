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


def _expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., KvH, L, D] -> [..., H, L, D]: repeat each KV head for its query group (a plain
    expansion lets SDPA pick its fused kernel, which `enable_gqa` does not on CPU)."""
    groups = num_heads // x.shape[-3]
    return x if groups == 1 else x.repeat_interleave(groups, dim=-3)


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_prefix: int,
                      scale: float) -> torch.Tensor:
    """Causal attention of T new queries over `num_prefix` earlier tokens plus themselves.

    q: [T, H, D]; keys/values: [num_prefix + T, KvH, D]. Query i sits at position num_prefix + i.
    """
    num_new, num_heads = q.shape[0], q.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)
    kh = _expand_kv(keys.transpose(0, 1), num_heads).unsqueeze(0)
    vh = _expand_kv(values.transpose(0, 1), num_heads).unsqueeze(0)
    if num_prefix == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        total = num_prefix + num_new
        key_pos = torch.arange(total, device=q.device)
        query_pos = torch.arange(num_prefix, total, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query per sequence over its padded context.

    q: [B, H, D]; keys/values: [B, L, KvH, D]; valid: [B, L] bool (False = padding).
    """
    num_heads = q.shape[1]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), _expand_kv(keys.transpose(1, 2), num_heads), _expand_kv(values.transpose(1, 2), num_heads),
        attn_mask=valid[:, None, None, :], scale=scale)
    return out.squeeze(2)

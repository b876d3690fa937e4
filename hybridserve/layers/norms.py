"""RMSNorm variants used by Qwen3.5 (computed in float32, each one fused `rms_norm` call)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.layers.native import chunk_rows_apply, gated_rms_norm_f32, rms_norm_applies, rms_norm_f32


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose weight is stored centred on zero: y = norm(x) * (1 + w), computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self.scale: torch.Tensor | None = None

    def pack(self) -> None:
        """Precompute the effective float32 scale (1 + w) once the weight is loaded; the scale
        replaces the stored weight (one copy)."""
        if self.scale is not None:
            return
        self.scale = (1.0 + self.weight.detach().float()).contiguous()
        del self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale if self.scale is not None else 1.0 + self.weight.float()  # before pack()
        if rms_norm_applies(x, scale):  # decode rows or a short chunk, float32 on CPU: one C call, not six ops
            return rms_norm_f32(x, scale, self.eps)
        if x.dtype == torch.float32:  # skips two no-op conversions, which cost dispatch in decode
            return F.rms_norm(x, (x.shape[-1],), scale, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), scale, self.eps).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm followed by a SiLU gate: y = w * norm(x) * silu(z) (the GDN output norm)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            if chunk_rows_apply(x, gate):  # a short chunk: one C pass, not three parallel ops
                return gated_rms_norm_f32(x, gate, self.weight, self.eps)
            # The same products in the same order as below, without the no-op conversions.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps).mul_(F.silu(gate))
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(dtype)
        return (self.weight * normed * F.silu(gate.float())).to(dtype)

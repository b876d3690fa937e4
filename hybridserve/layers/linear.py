"""Inference GEMMs with weights repacked once into the backend's fastest layout.

On CPU the weights go to oneDNN's blocked layout, which runs decode-sized batches ~2-3x and
prefill ~1.2x faster than MKL on the row-major weight (float32; bfloat16 too on CPUs with
native bf16 instructions). Elsewhere (CUDA, other dtypes,
builds without oneDNN) the weight stays a plain contiguous [out, in] matrix used via F.linear.
Projections that read the same input are fused into one matrix (concatenated outputs).

Memory: a `PackedLinear` owns the only copy of its weights. A single plain linear keeps the
loaded tensor itself (no copy); a fused or repacked one builds a new tensor, and the owning module
then drops its Hugging Face-named parameters (`drop_linears`), so every weight exists once.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)
ONEDNN_BATCH_HINT = 2048  # oneDNN picks its blocking for this many rows; it serves 1..4k rows well


def _onednn_usable(weight: torch.Tensor) -> bool:
    """float32 always; bfloat16 only where the CPU has native bf16 dot products (AVX512-BF16/AMX),
    which makes oneDNN's bf16 GEMM ~2x faster than float32 instead of far slower."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


class PackedLinear:
    """y = act(x @ W.T (+ b)) for one or more fused linears; outputs split as the fused widths.
    `activation` is "none" or "silu" (fused into the GEMM on oneDNN)."""

    def __init__(self, linears: list[nn.Module], activation: str = "none", allow_repack: bool = True) -> None:
        """Fuse the `.weight` ([out, in]) and optional `.bias` of `linears` (Linear or Embedding).
        `allow_repack=False` keeps the plain matrix (for a weight that must stay shared, such as
        tied embeddings: the blocked layout would be a second copy)."""
        if activation not in ("none", "silu"):
            raise ValueError(f"unsupported activation {activation!r}")
        self.activation = activation
        weight = _fused([lin.weight.detach() for lin in linears])
        biases = [getattr(lin, "bias", None) for lin in linears]
        self.bias = _fused([b.detach() for b in biases]) if biases[0] is not None else None
        self.widths = [lin.weight.shape[0] for lin in linears]
        self.onednn = False
        if allow_repack and _onednn_usable(weight):
            try:
                self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_BATCH_HINT)
                self.onednn = True
                return
            except RuntimeError:  # an unusual build: fall back to the plain matrix
                logger.warning("oneDNN weight packing unavailable; using plain GEMMs")
        self.weight = weight

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this linear owns (weight, and bias if any)."""
        return [self.weight] + ([self.bias] if self.bias is not None else [])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn:
            post_op = "swish" if self.activation == "silu" else "none"
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, post_op, [], "")
        y = F.linear(x, self.weight, self.bias)
        return F.silu(y) if self.activation == "silu" else y

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Apply and split the output into the fused linears' parts."""
        return self(x).split(self.widths, dim=-1)


def _fused(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One contiguous tensor of `tensors` concatenated on dim 0; a single contiguous tensor is
    returned as is (no copy)."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0]
    return torch.cat(tensors).contiguous()


def drop_linears(module: nn.Module, names: list[str]) -> None:
    """Remove the named submodules (their weights now live in a `PackedLinear`)."""
    for name in names:
        delattr(module, name)


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's data (also for oneDNN's opaque blocked tensors, which have no storage)."""
    if tensor.layout == torch._mkldnn:  # type: ignore[attr-defined]
        return tensor.numel() * tensor.element_size()
    return tensor.untyped_storage().nbytes()


def tensor_key(tensor: torch.Tensor) -> int:
    """Identity of the memory behind a tensor (views of one storage share it)."""
    if tensor.layout == torch._mkldnn:  # type: ignore[attr-defined]
        return id(tensor)
    return tensor.untyped_storage().data_ptr()

"""Inference GEMMs with weights repacked once into the backend's fastest layout.

On CPU the weights go to oneDNN's blocked layout, which runs decode-sized batches ~2-3x and
prefill ~1.2x faster than MKL on the row-major weight (float32; bfloat16 too on CPUs with
native bf16 instructions). Elsewhere (CUDA, other dtypes,
builds without oneDNN) the weight stays a plain contiguous [out, in] matrix used via F.linear.
Projections that read the same input are fused into one matrix (concatenated outputs).

Weight-only int8 (`quantization="int8"`): each output channel is quantized symmetrically
(int8 values, one scale per channel, absmax / 127) when the model is packed, and the GEMM is
PyTorch's `_weight_int8pack_mm`, which reads the int8 weight directly. Its fast path takes
bfloat16 inputs (on this AVX2 CPU a float32 input is 2.4x slower than a float32 GEMM, bf16 2.2x
faster), so a float32 activation is rounded to bfloat16 for the GEMM and its output returned in
float32; everything outside the linears (norms, GDN state, attention) keeps the model dtype.
That kernel is a GEMV at heart: from INT8_DEQUANT_ROWS rows up (prefill chunks) dequantizing the
weight for the call and running the float GEMM is 2x faster (2048 rows: 34 vs 71 ms for a
1536x512 weight here), so prefill takes that path and keeps its activations in float.

Memory: a `PackedLinear` owns the only copy of its weights. A single plain linear keeps the
loaded tensor itself (no copy); a fused or repacked one builds a new tensor, and the owning module
then drops its Hugging Face-named parameters (`drop_linears`), so every weight exists once.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)
ONEDNN_BATCH_HINT = 2048  # oneDNN picks its blocking for this many rows; it serves 1..4k rows well
QUANTIZATION_METHODS = ("int8",)
INT8_DEQUANT_ROWS = 64  # from this many rows up, an int8 linear dequantizes its weight for the call


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

    def __init__(self, linears: list[nn.Module], activation: str = "none", allow_repack: bool = True,
                 quantization: str | None = None) -> None:
        """Fuse the `.weight` ([out, in]) and optional `.bias` of `linears` (Linear or Embedding).
        `allow_repack=False` keeps the plain matrix (for a weight that must stay shared, such as
        tied embeddings: the blocked layout would be a second copy, and it is never quantized).
        `quantization="int8"` stores the weight as per-channel int8 (see the module docstring)."""
        if activation not in ("none", "silu"):
            raise ValueError(f"unsupported activation {activation!r}")
        if quantization is not None and quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"unsupported quantization {quantization!r}; supported: {', '.join(QUANTIZATION_METHODS)}")
        self.activation = activation
        weight = _fused([lin.weight.detach() for lin in linears])
        biases = [getattr(lin, "bias", None) for lin in linears]
        self.bias = _fused([b.detach() for b in biases]) if biases[0] is not None else None
        self.widths = [lin.weight.shape[0] for lin in linears]
        self.onednn = False
        self.scales: torch.Tensor | None = None  # int8 only: per-output-channel scales (float32)
        self.kernel_scales: torch.Tensor | None = None  # int8 only: the same in the kernel's input dtype
        self.int8_kernel = False  # int8 only: PyTorch has the int8 GEMM for this device
        if allow_repack and quantization == "int8":
            self.weight, self.scales = quantize_int8(weight)
            self.int8_kernel = _int8_kernel_available(weight.device.type)
            # The kernel multiplies by scales in its input dtype; dequantizing uses the float32 ones.
            self.kernel_scales = self.scales.to(int8_gemm_dtype(weight.dtype))
            return
        if allow_repack and _onednn_usable(weight):
            try:
                self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_BATCH_HINT)
                self.onednn = True
                return
            except RuntimeError:  # an unusual build: fall back to the plain matrix
                logger.warning("oneDNN weight packing unavailable; using plain GEMMs")
        self.weight = weight

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this linear owns (weight, int8 scales and bias, where present)."""
        return [t for t in (self.weight, self.scales, self.kernel_scales, self.bias) if t is not None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scales is not None:
            return self._int8(x)
        if self.onednn:
            post_op = "swish" if self.activation == "silu" else "none"
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, post_op, [], "")
        y = F.linear(x, self.weight, self.bias)
        return F.silu(y) if self.activation == "silu" else y

    def _int8(self, x: torch.Tensor) -> torch.Tensor:
        assert self.scales is not None and self.kernel_scales is not None
        if self.int8_kernel and x.shape[0] < INT8_DEQUANT_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x.to(self.kernel_scales.dtype), self.weight,
                                                   self.kernel_scales).to(x.dtype)
        else:  # a prefill-sized batch, or no int8 kernel for this device: dequantize for the call
            y = F.linear(x, self.weight.to(x.dtype).mul_(self.scales.to(x.dtype)[:, None]))
        if self.bias is not None:
            y = y + self.bias
        return F.silu(y) if self.activation == "silu" else y

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Apply and split the output into the fused linears' parts."""
        return self(x).split(self.widths, dim=-1)


@functools.lru_cache(maxsize=None)
def _int8_kernel_available(device_type: str) -> bool:
    """Whether PyTorch has its weight-only int8 GEMM for this device type (warns once if not)."""
    available = torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", device_type.upper())
    if not available:
        logger.warning("no int8 weight-only GEMM for %s in this PyTorch build; int8 weights are "
                       "dequantized per call (correct but slower than the model dtype)", device_type)
    return bool(available)


def int8_gemm_dtype(activation_dtype: torch.dtype) -> torch.dtype:
    """Input dtype of the int8 GEMM: bfloat16 for a float32 model (the kernel's fast path),
    otherwise the model's own half-precision dtype."""
    return torch.bfloat16 if activation_dtype == torch.float32 else activation_dtype


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (int8 [out, in], float32 scales [out]) with
    weight ~= int8 * scale[:, None]; an all-zero row gets scale 1 (its values are 0)."""
    w = weight.float()
    scales = w.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return q, scales.contiguous()


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

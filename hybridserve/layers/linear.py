"""Inference GEMMs on the loaded row-major weights, with the kernel picked by rows, dtype and CPU.

Every linear keeps one plain contiguous [out, in] matrix (projections of one input fused), which
serves every row count and, tied, the LM head; int8 weights are quantized per output channel when
the model is packed. docs/cpu-kernels.md tables which kernel takes which rows.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.layers import native

logger = logging.getLogger(__name__)
GEMV_MAX_ROWS = 128  # up to this many rows a float32 CPU linear runs as a split GEMV
SPLIT_GEMM_ROWS = 8  # from this many rows the split GEMV multiplies the rows by each block's transpose
QUANTIZATION_METHODS = ("int8",)
INT8_DEQUANT_ROWS = 64  # from this many rows up, an int8 linear dequantizes its weight for the call


@functools.lru_cache(maxsize=1)
def split_bmm_preferred() -> bool:
    """Whether the split bmm takes SPLIT_GEMM_ROWS..GEMV_MAX_ROWS rows the C kernels do not: it beats
    oneDNN on AVX2, while on AVX-512 MKL's `F.linear` beats both."""
    return torch.backends.cpu.get_cpu_capability() != "AVX512"


def _onednn_usable(weight: torch.Tensor) -> bool:
    """float32 always; bfloat16 only where the CPU has native bf16 dot products (AVX512-BF16/AMX),
    without which oneDNN's bf16 GEMM is emulated and far slower than float32."""
    # torch.backends.mkldnn.is_available carries no annotations
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if not all(hasattr(torch.ops.mkldnn, op) for op in ("_linear_pointwise", "_reorder_linear_weight")):
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


class PackedLinear:
    """y = x @ W.T (+ b) for one or more fused linears (`split` by their widths; `silu_mul` for a
    fused [gate; up] pair). It owns the only copy of its weights."""

    def __init__(self, linears: Sequence[nn.Linear | nn.Embedding], allow_repack: bool = True,
                 quantization: str | None = None) -> None:
        """Fuse the `.weight` ([out, in]) and optional `.bias` of `linears` (Linear or Embedding).
        `allow_repack=False` keeps the loaded matrix as it is, never quantized (a shared weight such
        as tied embeddings); `quantization="int8"` stores per-channel int8."""
        if quantization is not None and quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"unsupported quantization {quantization!r}; supported: {', '.join(QUANTIZATION_METHODS)}")
        weight = _fused([lin.weight.detach() for lin in linears])
        biases = [bias.detach() for lin in linears if (bias := getattr(lin, "bias", None)) is not None]
        if biases and len(biases) != len(linears):
            raise ValueError("PackedLinear: fused linears must all have a bias or none")
        self.bias = _fused(biases) if biases else None
        self.widths = [lin.weight.shape[0] for lin in linears]
        self.onednn = False  # float32 CPU prefill rows use oneDNN's GEMM on the plain weight
        self.split_gemv = False  # float32 CPU: up to GEMV_MAX_ROWS rows run as a split GEMV
        self.bf16_cpu = False  # bfloat16 CPU: decode rows in float32 by the C GEMV
        self.native_bf16 = False  # bfloat16 CPU with bf16 instructions: prefill rows in PyTorch's bf16 GEMM
        self.scales: torch.Tensor | None = None  # int8 only: per-output-channel scales (float32)
        self.kernel_scales: torch.Tensor | None = None  # int8 only: the same in the kernel's input dtype
        self.int8_kernel = False  # int8 only: PyTorch has the int8 GEMM for this device
        if allow_repack and quantization == "int8":
            self.weight, self.scales = quantize_int8(weight)
            self.int8_kernel = _int8_kernel_available(weight.device.type)
            # The kernel multiplies by scales in its input dtype; dequantizing uses the float32 ones.
            self.kernel_scales = self.scales.to(int8_gemm_dtype(weight.dtype))
            return
        self.weight = weight
        cpu = weight.device.type == "cpu"
        self.split_gemv = cpu and weight.dtype == torch.float32
        self.onednn = self.split_gemv and _onednn_usable(weight)
        self.bf16_cpu = cpu and weight.dtype == torch.bfloat16
        self.native_bf16 = self.bf16_cpu and _onednn_usable(weight)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors this linear owns (weight, int8 scales and bias, where present) by attribute."""
        names = ("weight", "scales", "kernel_scales", "bias")
        return [(name, tensor) for name in names if (tensor := getattr(self, name)) is not None]

    def tensors(self) -> list[torch.Tensor]:
        """The tensors of `named_tensors`."""
        return [tensor for _, tensor in self.named_tensors()]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scales is not None:
            return self._int8(x)
        if self._takes_split_gemv(x):
            return self._split_gemv(x)
        if self.bf16_cpu:
            return self._bf16(x)
        if self.onednn:
            y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
            return y
        return F.linear(x, self.weight, self.bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ G.T) * (x @ U.T) for a linear fused from [gate, up] of equal widths (the MLP): the
        C tile GEMM writes the product itself; on oneDNN, SiLU rides the gate GEMM as its post-op."""
        if self.onednn and not self._takes_split_gemv(x):
            half = self.weight.shape[0] // 2
            gate_bias, up_bias = (None, None) if self.bias is None else (self.bias[:half], self.bias[half:])
            gate: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.weight[:half], gate_bias, "swish", [], "")
            return gate.mul_(torch.ops.mkldnn._linear_pointwise(x, self.weight[half:], up_bias, "none", [], ""))
        if self.bias is None and native.gemm_rows_applies(self.weight, x):  # float32 or int8 on CPU
            return native.gemm_rows_silu_mul(self.weight, x, self.scales)  # the product written by the GEMM itself
        fused = self(x)
        if native.chunk_rows_apply(fused):  # a short chunk: one C pass, not two parallel ops
            return native.silu_mul_f32(fused)
        gate, up = fused.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def _takes_split_gemv(self, x: torch.Tensor) -> bool:
        return self.split_gemv and x.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_ROWS

    def _split_gemv(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for up to GEMV_MAX_ROWS rows: the C GEMM or GEMV where they take the rows, else MKL
        or one bmm over contiguous row blocks of W (one block per thread below SPLIT_GEMM_ROWS rows,
        four from there), so each thread streams its own part of the weight."""
        rows = x.shape[0]
        out_features, in_features = self.weight.shape
        threads = torch.get_num_threads()
        if native.gemm_rows_applies(self.weight, x):
            y = native.gemm_rows(self.weight, x)
        elif native.gemv_applies(self.weight, x):
            y = native.gemv(self.weight, x)
        elif rows >= SPLIT_GEMM_ROWS and not split_bmm_preferred():
            y = F.linear(x, self.weight)
        elif rows < SPLIT_GEMM_ROWS:
            splits = gemv_splits(out_features, threads)
            blocks = self.weight.view(splits, out_features // splits, in_features)
            y = torch.bmm(blocks, x.t().expand(splits, in_features, rows))  # [splits, out / splits, rows]
            y = y.view(1, out_features) if rows == 1 else y.view(out_features, rows).t().contiguous()
        else:
            splits = gemv_splits(out_features, 4 * threads)
            blocks = self.weight.view(splits, out_features // splits, in_features).transpose(1, 2)
            y = torch.bmm(x.expand(splits, rows, in_features), blocks)  # [splits, rows, out / splits]
            y = y.transpose(0, 1).reshape(rows, out_features)
        return y.add_(self.bias) if self.bias is not None else y

    def _bf16(self, x: torch.Tensor) -> torch.Tensor:
        """A bfloat16 CPU weight: decode rows in float32 by the C GEMV and rounded back; more rows by
        PyTorch's bf16 GEMM where the CPU has bf16 instructions, else by the float32 GEMM on a copy
        widened for the call."""
        if x.dim() == 2 and 0 < x.shape[0] <= native.GEMV_DECODE_ROWS:
            rows = x.float()
            if native.gemv_applies(self.weight, rows):
                y = native.gemv(self.weight, rows)
                return (y.add_(self.bias.float()) if self.bias is not None else y).to(x.dtype)
        if self.native_bf16:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x.float(), self.weight.float())
        if self.bias is not None:
            y = y.add_(self.bias.float())
        return y.to(x.dtype)

    def _int8(self, x: torch.Tensor) -> torch.Tensor:
        if self.scales is None or self.kernel_scales is None:
            raise ValueError("PackedLinear: an int8 weight needs its scales")
        if native.gemm_rows_applies(self.weight, x):  # the C GEMM and GEMV widen int8 in registers
            y = native.gemm_rows(self.weight, x, self.scales)
        elif native.gemv_applies(self.weight, x, native.gemv_preferred_rows()):
            y = native.gemv(self.weight, x, self.scales)
        elif self.int8_kernel and x.shape[0] < INT8_DEQUANT_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x.to(self.kernel_scales.dtype), self.weight,
                                                   self.kernel_scales).to(x.dtype)
        else:  # a prefill-sized batch, or no int8 kernel for this device: dequantize for the call
            y = F.linear(x, self.weight.to(x.dtype).mul_(self.scales.to(x.dtype)[:, None]))
        return y + self.bias if self.bias is not None else y

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Apply and split the output into the fused linears' parts."""
        return torch.split(self(x), self.widths, dim=-1)


@functools.cache
def gemv_splits(out_features: int, max_blocks: int) -> int:
    """Row blocks of a split GEMV: the most blocks, up to `max_blocks`, that divide `out_features`."""
    return next(s for s in range(max(1, max_blocks), 0, -1) if out_features % s == 0)


@functools.cache
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
    """`tensors` concatenated on dim 0, contiguous; a single contiguous tensor as is (no copy)."""
    return tensors[0] if len(tensors) == 1 and tensors[0].is_contiguous() else torch.cat(tensors).contiguous()


def pack_linears(module: nn.Module, quantization: str | None, **fused: list[str]) -> None:
    """Set each attribute of `fused` on `module` to a PackedLinear of the named submodule linears,
    then remove those submodules (their weights now live in the PackedLinears)."""
    for attribute, names in fused.items():
        setattr(module, attribute, PackedLinear([getattr(module, name) for name in names], quantization=quantization))
    for name in (name for names in fused.values() for name in names):
        delattr(module, name)


def union_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the memory the tensors span, each byte counted once however many tensors view it
    (per device: the same address on two devices is two bytes)."""
    spans: dict[torch.device, list[tuple[int, int]]] = {}
    for tensor in tensors:
        if tensor.numel() == 0:
            continue
        extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
        start = tensor.data_ptr()
        spans.setdefault(tensor.device, []).append((start, start + extent * tensor.element_size()))
    total = 0
    for ranges in spans.values():
        end = -1
        for start, stop in sorted(ranges):
            total += max(0, stop - max(start, end))
            end = max(end, stop)
    return total

"""Inference GEMMs on the loaded row-major weights, with the kernel picked by batch size.

On CPU in float32 the weight stays one plain contiguous [out, in] matrix and serves every batch size:
- up to 16 rows (decode; 5 where the C GEMM below runs), the C GEMV of csrc/gemv.c (int8 weights
  up to 32 rows on AVX-512, see
  `native.gemv_preferred_rows()`), in which each thread streams one weight row after another and
  dots it with every input row while it is in L1 (on the 2-core AVX2 host, the built-in model's linears take
  0.83-0.88x the split `bmm`'s time at one row, 0.56-0.67x at 8, 0.70-0.91x at 16; on the AVX-512
  host 0.63x oneDNN's at 17 rows, 0.91x at 32);
- from 6 up to 128 rows on AVX-512 (decode batches, short prefills such as a warm
  request's 64-token suffix), the C GEMM of csrc/gemm_rows.c on the same plain weight: 4x6
  register tiles of dot products, no packing, blocks handed out on the kernels' task pool (the
  built-in model's linears at 64 rows 14.9 against 16.3-17.0 ms for MKL, and faster than the GEMV
  from 6 rows since it prefetches the next weight rows a line per k-step: 4.6 vs 5.3 ms at 16
  rows; the MLP's silu(gate) * up is written by it directly, `silu_mul`);
- otherwise up to GEMV_MAX_ROWS rows (and every small batch when the C kernels are off), a
  *split GEMV*: the matrix viewed as blocks of whole rows and one `torch.bmm` over the blocks,
  which the threads share out (a warm 4096+64-token TTFT 0.94x, a cold 64-token one 0.87x the time
  with the bound at 32 rows instead of 128). Each thread streams its own
  contiguous part of the weight; below SPLIT_GEMM_ROWS rows there is one block per thread, from
  there four per thread with the rows multiplied by each block's transpose (the better of the two
  where the rows make it compute-bound: 0.84-0.96x oneDNN's time on the plain weight from 33 to
  128 rows, 1.05-1.09x at 256; on the AVX-512 host MKL's `F.linear` takes these rows instead, see
  `split_bmm_preferred`). Measured on a 2-core AVX2 host with cold weights, the
  built-in model's linears on one row take 10.5 ms instead of 12.5 ms with oneDNN's pre-packed
  weights (its 4096x512 LM head 0.6 vs 1.5 ms with `F.linear`), and a whole batch-1 decode step
  0.81x the time; a batch-16 step is as fast as with pre-packed weights (0.99x);
- above GEMV_MAX_ROWS rows (long prefills), oneDNN's GEMM on the same plain weight. It reorders the
  weight per call, which costs under 5% from 128 rows up next to a pre-packed weight, and it is
  15-30% faster than MKL's `F.linear` at 2048 rows.
One plain matrix serves both, where a pre-packed layout would need a second copy to keep the
GEMV fast, and tied embeddings share it with the LM head.
bfloat16 on CPU also keeps the one plain matrix. Decode rows (up to the C GEMV's bound) are
computed in float32 by the C GEMV reading the bf16 weight (from 6 rows on AMX tiles where the CPU
has them, csrc/gemm_amx.c, every product still exact) and rounded back, so the one-call decode
step (engine/one_call_step.py) can read the same weight. More rows take PyTorch's bf16 GEMM where the
CPU has native bf16 instructions (AVX512-BF16/AMX: oneDNN on the plain weight is within 0.97-1.33x
of its pre-packed layout, equal at 2048 rows, and 7x faster than float32 there), and otherwise the
float32 GEMM on a copy widened for the call: without them PyTorch's bf16 GEMM is emulated (a cold
4160-token bf16 prefill took 14.5 s on the AVX2 host, 3.4x llama.cpp's time; widened, a cold
2048-token one took 2.2 s instead of 11.9 s). On the AMX host a pre-packed weight had served decode
too, at 12.7 ms per token against 5.2 for float32 in the same run (`bench decode`).
Elsewhere (CUDA, other dtypes, builds without oneDNN) the plain matrix is used via F.linear.
Projections that read the same input are fused into one matrix (concatenated outputs).

Weight-only int8 (`quantization="int8"`): each output channel is quantized symmetrically
(int8 values, one scale per channel, absmax / 127) when the model is packed. Float32 CPU rows up to
the C GEMV's bound take the C kernels (int8 widened to float32 in registers, activations in float32):
the GEMV (2.15 vs 6.54 ms for the built-in model's int8 linears on one row; on the AVX-512 host at
17, 24 and 32 rows 5.9, 7.5 and 11.3 ms against 9.4, 12.7 and 15.3 with `_weight_int8pack_mm`), and
on AVX-512 from 6 rows the tile GEMM of csrc/gemm_rows.c instead (0.77x, 0.70x and 0.63x the GEMV's
time at 8, 16 and 32 rows; from 8 rows on AMX tiles where the CPU has them, csrc/gemm_amx.c);
bfloat16 keeps the 16-row bound, since from ~20 rows its AMX GEMM is faster: 5.7-5.9 ms at 24-32
rows against 6.3-9.4. Otherwise the GEMM is
PyTorch's `_weight_int8pack_mm`, which reads the int8 weight directly. Its fast path takes
bfloat16 inputs (on this AVX2 CPU a float32 input is 2.4x slower than a float32 GEMM, bf16 2.2x
faster), so a float32 activation is rounded to bfloat16 for the GEMM and its output returned in
float32; everything outside the linears (norms, GDN state, attention) keeps the model dtype.
That kernel is a GEMV at heart: from INT8_DEQUANT_ROWS rows up (prefill chunks) dequantizing the
weight for the call and running the float GEMM is 2x faster (2048 rows: 34 vs 71 ms for a
1536x512 weight here), so prefill takes that path and keeps its activations in float.

Memory: a `PackedLinear` owns the only copy of its weights. A single plain linear keeps the
loaded tensor itself (no copy); a fused or quantized one builds a new tensor, and the owning module
then drops its Hugging Face-named parameters (`drop_linears`), so every weight exists once.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.layers import native


logger = logging.getLogger(__name__)
GEMV_MAX_ROWS = 128  # up to this many rows a float32 CPU linear runs as a split GEMV (see above)
SPLIT_GEMM_ROWS = 8  # from this many rows the split GEMV multiplies the rows by each block's transpose
QUANTIZATION_METHODS = ("int8",)
INT8_DEQUANT_ROWS = 64  # from this many rows up, an int8 linear dequantizes its weight for the call


@functools.lru_cache(maxsize=1)
def split_bmm_preferred() -> bool:
    """Whether the split bmm takes SPLIT_GEMM_ROWS..GEMV_MAX_ROWS rows the C GEMV does not: on the
    AVX2 host it beat oneDNN there (0.84-0.96x its time), on the AVX-512 host MKL's `F.linear` beat
    both (the built-in model's linears, cold: 18.1 ms vs 19.5 for oneDNN and 22.7 split at 64 rows,
    27.8 vs 28.8 and 34.8 at 128; oneDNN leads again from ~192)."""
    return torch.backends.cpu.get_cpu_capability() != "AVX512"


def _onednn_usable(weight: torch.Tensor) -> bool:
    """float32 always; bfloat16 only where the CPU has native bf16 dot products (AVX512-BF16/AMX),
    which makes oneDNN's bf16 GEMM ~2x faster than float32 instead of far slower."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not all(hasattr(torch.ops.mkldnn, op) for op in ("_linear_pointwise", "_reorder_linear_weight")):
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


class PackedLinear:
    """y = x @ W.T (+ b) for one or more fused linears; outputs split as the fused widths, and
    `silu_mul` for a fused [gate; up] pair."""

    def __init__(self, linears: list[nn.Module], allow_repack: bool = True, quantization: str | None = None) -> None:
        """Fuse the `.weight` ([out, in]) and optional `.bias` of `linears` (Linear or Embedding).
        `allow_repack=False` keeps the loaded matrix as it is, never quantized (for a weight that
        must stay shared, such as tied embeddings).
        `quantization="int8"` stores the weight as per-channel int8 (see the module docstring)."""
        if quantization is not None and quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"unsupported quantization {quantization!r}; supported: {', '.join(QUANTIZATION_METHODS)}")
        weight = _fused([lin.weight.detach() for lin in linears])
        biases = [getattr(lin, "bias", None) for lin in linears]
        self.bias = _fused([b.detach() for b in biases]) if biases[0] is not None else None
        self.widths = [lin.weight.shape[0] for lin in linears]
        self.onednn = False  # float32 CPU prefill rows use oneDNN's GEMM on the plain weight
        self.split_gemv = False  # float32 CPU: few rows run as a split GEMV (see the module docstring)
        self.bf16_cpu = False  # bfloat16 CPU: decode rows in float32 by the C GEMV (see the module docstring)
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

    TENSOR_ATTRIBUTES = ("weight", "scales", "kernel_scales", "bias")

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this linear owns (weight, int8 scales and bias, where present), in the
        order of TENSOR_ATTRIBUTES."""
        return [t for t in (getattr(self, name) for name in self.TENSOR_ATTRIBUTES) if t is not None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scales is not None:
            return self._int8(x)
        if self._takes_split_gemv(x):
            return self._split_gemv(x)
        if self.bf16_cpu:
            return self._bf16(x)
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ G.T) * (x @ U.T) for a linear fused from [gate, up] of equal widths (the MLP):
        one GEMV over both for a few rows; for 6-128 rows (int8: 6-32) on AVX-512 the C GEMM
        writes the product itself; for prefill on oneDNN, SiLU rides the gate GEMM as its post-op,
        which beats SiLU and product over the strided halves of one output."""
        if self.onednn and not self._takes_split_gemv(x):
            half = self.weight.shape[0] // 2
            gate_bias, up_bias = (None, None) if self.bias is None else (self.bias[:half], self.bias[half:])
            gate = torch.ops.mkldnn._linear_pointwise(x, self.weight[:half], gate_bias, "swish", [], "")
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
        """x @ W.T for a few rows (see the module docstring): the C GEMM for the rows it takes, the
        C GEMV up to its row bound, else MKL or one bmm over contiguous row blocks of W, one block
        per thread below SPLIT_GEMM_ROWS rows, four per thread from there."""
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
        """A bfloat16 CPU weight (see the module docstring): decode rows computed in float32 by the
        C GEMV (which widens the weight in registers) and rounded back to x's dtype; more rows by
        PyTorch's bf16 GEMM on a CPU with bf16 instructions, else by the float32 GEMM on a widened
        copy of the weight made for the call (PyTorch's bf16 GEMM is emulated there)."""
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
        return self(x).split(self.widths, dim=-1)


@functools.lru_cache(maxsize=None)
def gemv_splits(out_features: int, max_blocks: int) -> int:
    """Row blocks of a split GEMV: the most blocks, up to `max_blocks`, that divide `out_features`."""
    return next(s for s in range(max(1, max_blocks), 0, -1) if out_features % s == 0)


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

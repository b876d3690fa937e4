"""The fused C decode kernel (hybridserve/layers/native.py): exact against the eager ops, in-place
updates undone when a forward fails, bad slots rejected, and a clean fallback without it."""

from __future__ import annotations

import ast
import ctypes
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hybridserve.config import CacheConfig, EngineConfig
from hybridserve.engine import one_call_step
from hybridserve.engine.engine import LLMEngine
from hybridserve.layers import kernel_abi, native
from hybridserve.layers.attention import prefill_attention
from hybridserve.layers.gated_delta import (
    L2_NORM_EPS,
    causal_conv_decode,
    causal_conv_prefill,
    chunked_gated_delta,
    conv_state_after,
    recurrent_gated_delta_step,
)
from hybridserve.layers.norms import GatedRMSNorm, ZeroCenteredRMSNorm
from hybridserve.layers.rotary import PartialRotaryEmbedding
from hybridserve.models.batch import ForwardBatch
from hybridserve.models.qwen3_5 import ForwardContext
from tests.helpers.greedy_runs import run_greedy

HAVE_COMPILER = shutil.which("cc") is not None or shutil.which("gcc") is not None
needs_kernel = pytest.mark.skipif(not HAVE_COMPILER, reason="no C compiler: the eager path is used")


def test_the_kernel_builds_where_a_c_compiler_exists() -> None:
    assert native.native_kernels_enabled() == HAVE_COMPILER


class _Layer:
    """Random inputs of one GDN layer: value heads grouped over key heads, a head size that is not a
    multiple of the vector width, a strided projection (the in_proj output with z between)."""

    def __init__(self, batch: int = 3, hk: int = 2, hv: int = 6, dk: int = 12, dv: int = 10, kernel: int = 4,
                 num_slots: int = 7, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.hk, self.hv, self.dk, self.dv = hk, hv, dk, dv
        self.conv_dim = 2 * hk * dk + hv * dv
        self.b_offset = self.conv_dim + hv * dv
        self.projection = torch.randn(batch, self.b_offset + 2 * hv, generator=gen)
        self.conv_live = torch.randn(num_slots, self.conv_dim, kernel - 1, generator=gen)
        self.rec_live = torch.randn(num_slots, hv, dk, dv, generator=gen) * 0.3
        self.weight = torch.randn(self.conv_dim, kernel, generator=gen) * 0.3
        self.dt_bias = torch.randn(hv, generator=gen)
        self.neg_decay_rate = -torch.rand(hv, generator=gen) * 8
        self.slots = torch.randperm(num_slots, generator=gen)[:batch]

    def eager(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = self.projection.shape[0]
        mixed = self.projection[:, :self.conv_dim]
        b = self.projection[:, self.b_offset:self.b_offset + self.hv]
        a = self.projection[:, self.b_offset + self.hv:]
        beta, g = torch.sigmoid(b), self.neg_decay_rate * F.softplus(a + self.dt_bias)
        conv_out, new_conv = causal_conv_decode(mixed, self.conv_live.index_select(0, self.slots), self.weight)
        qk, v = conv_out.split([2 * self.hk * self.dk, self.hv * self.dv], dim=-1)
        core, new_state = recurrent_gated_delta_step(qk.reshape(rows, 2 * self.hk, self.dk),
                                                     v.reshape(rows, self.hv, self.dv), g, beta,
                                                     self.rec_live.index_select(0, self.slots))
        return core, new_conv, new_state

    def fused(self, in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return native.gdn_decode_f32(self.projection, self.b_offset, self.b_offset + self.hv, self.slots,
                                     self.conv_live, self.rec_live, self.weight, self.dt_bias,
                                     self.neg_decay_rate, self.hk, L2_NORM_EPS, in_place=in_place)


# The odd shape takes the scalar conv; the second (conv_dim 128, kernel 4) the AVX-512 conv where
# the CPU has it, and with 2 threads its 5 sequences run as one task each (conv, then every head).
GDN_SHAPES: list[dict[str, int]] = [{}, {"batch": 5, "hk": 2, "hv": 4, "dk": 16, "dv": 16, "num_slots": 9}]


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", GDN_SHAPES, ids=["odd", "aligned"])
def test_fused_gdn_decode_matches_the_eager_ops(threads: int, shape: dict[str, int],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    layer = _Layer(**shape)
    conv_before, rec_before = layer.conv_live.clone(), layer.rec_live.clone()
    core, new_conv, new_state = layer.eager()
    fused_core, fused_conv, fused_state = layer.fused()
    torch.testing.assert_close(fused_core, core, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_conv, new_conv, atol=0, rtol=0)
    torch.testing.assert_close(fused_state, new_state, atol=1e-5, rtol=1e-5)
    assert torch.equal(layer.conv_live, conv_before) and torch.equal(layer.rec_live, rec_before)

    in_place_core, undo_conv, undo_state = layer.fused(in_place=True)
    assert torch.equal(in_place_core, fused_core)
    assert torch.equal(undo_conv, conv_before[layer.slots]) and torch.equal(undo_state, rec_before[layer.slots])
    assert torch.equal(layer.conv_live[layer.slots], fused_conv)
    assert torch.equal(layer.rec_live[layer.slots], fused_state)
    others = [s for s in range(layer.rec_live.shape[0]) if s not in layer.slots.tolist()]
    assert torch.equal(layer.rec_live[others], rec_before[others])


@needs_kernel
def test_fused_output_norm_matches_the_gated_rms_norm() -> None:
    layer = _Layer(seed=1)
    core, _, _ = layer.eager()
    norm = GatedRMSNorm(layer.dv, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(layer.dv) + 0.5)
    z = layer.projection[:, layer.conv_dim:layer.conv_dim + layer.hv * layer.dv].reshape(-1, layer.dv)
    expected = norm(core.reshape(-1, layer.dv), z).reshape(core.shape)
    fused, _, _ = native.gdn_decode_f32(layer.projection, layer.b_offset, layer.b_offset + layer.hv, layer.slots,
                                        layer.conv_live, layer.rec_live, layer.weight, layer.dt_bias,
                                        layer.neg_decay_rate, layer.hk, L2_NORM_EPS,
                                        norm_weight=norm.weight.detach(), norm_eps=norm.eps)
    torch.testing.assert_close(fused, expected, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tokens", [1, 37, 130])
def test_token_by_token_prefill_matches_the_chunked_form(tokens: int, threads: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk starting off a chunk boundary, with captures given out of order, one of them twice."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(tokens)
    hk, hv, dk, dv, kernel, start = 2, 6, 12, 10, 4, 100
    conv_dim = 2 * hk * dk + hv * dv
    projection = torch.randn(tokens, conv_dim + 5, generator=gen)
    x, conv_state = projection[:, :conv_dim], torch.randn(conv_dim, kernel - 1, generator=gen)  # strided rows
    weight = torch.randn(conv_dim, kernel, generator=gen) * 0.3
    g, beta = -torch.rand(tokens, hv, generator=gen) * 2, torch.rand(tokens, hv, generator=gen)
    state = torch.randn(hv, dk, dv, generator=gen) * 0.3
    captures = sorted({tokens, (tokens + 1) // 2, 1}, reverse=True) + [tokens]
    conv_out, window = causal_conv_prefill(x, conv_state, weight)
    q, k, v = conv_out.split([hk * dk, hk * dk, hv * dv], dim=-1)
    expected = chunked_gated_delta(q.reshape(tokens, hk, dk), k.reshape(tokens, hk, dk), v.reshape(tokens, hv, dv),
                                   g, beta, state, chunk_size=16, start_position=start,
                                   capture_at=[start + c for c in captures])
    state_before = state.clone()
    core, final, captured = native.gdn_prefill_f32(x, conv_state, g, beta, state, weight, hk, L2_NORM_EPS, captures)
    torch.testing.assert_close(core, expected.output, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, expected.final_state, atol=1e-5, rtol=1e-5)
    assert len(captured) == len(captures)
    for got, want in zip(captured, expected.captured):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(state, state_before)  # the live state is only read
    with pytest.raises(ValueError, match="within"):
        native.gdn_prefill_f32(x, conv_state, g, beta, state, weight, hk, L2_NORM_EPS, [tokens + 1])
    with pytest.raises(ValueError, match="disagree"):
        native.gdn_prefill_f32(x[:, 1:], conv_state, g, beta, state, weight, hk, L2_NORM_EPS, [])
    for consumed in (0, 1, 2, tokens):  # the conv state at any boundary, as a slice of the window
        torch.testing.assert_close(conv_state_after(conv_state, x, consumed), window[:, consumed:consumed + kernel - 1],
                                   atol=0, rtol=0)


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 512), (3, 8, 64), (64, 20), (64, 512), (64, 8, 64)])
def test_rms_norm_matches_torch(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(2)
    x, scale = torch.randn(*shape, generator=gen) * 3, torch.rand(shape[-1], generator=gen) + 0.5
    assert native.rms_norm_applies(x, scale)
    torch.testing.assert_close(native.rms_norm_f32(x, scale, 1e-6), F.rms_norm(x, (shape[-1],), scale, 1e-6),
                               atol=1e-5, rtol=1e-5)
    assert ZeroCenteredRMSNorm(shape[-1])(x).shape == x.shape  # the module takes the kernel too


@needs_kernel
def test_rms_norm_reads_evenly_spaced_rows_of_a_fused_projection() -> None:
    """The attention's q heads are every other 64 columns of the fused q|gate projection."""
    fused = torch.randn(2, 4, 2 * 64)
    q = fused.chunk(2, dim=-1)[0]
    scale = torch.rand(64) + 0.5
    assert native.row_stride(q) == 128 and native.rms_norm_applies(q, scale)
    torch.testing.assert_close(native.rms_norm_f32(q, scale, 1e-6), F.rms_norm(q, (64,), scale, 1e-6))


@needs_kernel
@pytest.mark.parametrize("layout", ["q", "k"])
@pytest.mark.parametrize("tokens", [2, 64])
def test_norm_rope_matches_the_eager_ops(tokens: int, layout: str) -> None:
    """Decode rows and a short chunk (a warm request's 64-token suffix), with the heads laid out as
    in the fused q|k|v projection: q heads every other 64 columns (q|gate), k heads contiguous inside
    a wider token row."""
    gen = torch.Generator().manual_seed(3)
    rotary = PartialRotaryEmbedding(head_dim=64, rotary_dim=16, theta=10_000.0, max_positions=128)
    norm = ZeroCenteredRMSNorm(64)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen) * 0.1)
    norm.pack()
    fused = torch.randn(tokens, 6 * 64 + 2 * 64 + 2 * 64, generator=gen)
    if layout == "q":
        x = fused[:, :6 * 64].reshape(tokens, 3, 2 * 64).chunk(2, dim=-1)[0]
    else:
        x = fused[:, 6 * 64:8 * 64].reshape(tokens, 2, 64)
    cos, sin = rotary.cos_sin(torch.randint(0, 128, (tokens,), generator=gen), torch.float32)
    assert norm.scale is not None and native.norm_rope_applies(x, norm.scale)
    expected = rotary.rotate(F.rms_norm(x, (64,), norm.scale, norm.eps), cos, sin)
    torch.testing.assert_close(native.rms_norm_rope_f32(x, norm.scale, norm.eps, cos, sin), expected)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 7, 512])
def test_gate_kernels_match_torch(rows: int) -> None:
    """The GDN output norm with its SiLU gate and the MLP's silu(gate) * up on a short chunk; the
    gate rows of the norm are evenly spaced columns of a wider projection, as in the model."""
    gen = torch.Generator().manual_seed(4)
    x, scale = torch.randn(rows, 64, generator=gen) * 3, torch.rand(64, generator=gen) + 0.5
    gate = (torch.randn(rows, 192, generator=gen) * 6)[:, 64:128]  # wide enough to reach SiLU's tails
    assert native.chunk_rows_apply(x, gate)
    torch.testing.assert_close(native.gated_rms_norm_f32(x, gate, scale, 1e-6),
                               F.rms_norm(x, (64,), scale, 1e-6) * F.silu(gate), atol=1e-5, rtol=1e-5)
    norm = GatedRMSNorm(64)
    with torch.no_grad():
        norm.weight.copy_(scale)
    torch.testing.assert_close(norm(x, gate), F.rms_norm(x, (64,), scale, 1e-6) * F.silu(gate), atol=1e-5, rtol=1e-5)
    fused = torch.randn(min(rows, 64), 2 * 96, generator=gen) * 6
    gate_half, up = fused.chunk(2, dim=-1)
    torch.testing.assert_close(native.silu_mul_f32(fused), F.silu(gate_half) * up, atol=1e-5, rtol=1e-5)


def test_gate_kernels_leave_long_chunks_and_other_dtypes_to_torch() -> None:
    assert not native.chunk_rows_apply(torch.randn(native.CHUNK_MAX_ELEMENTS + 1))
    assert not native.chunk_rows_apply(torch.randn(4, 16, dtype=torch.bfloat16))
    assert not native.chunk_rows_apply(torch.randn(4, 16), torch.randn(16, 4).t())
    with pytest.raises(ValueError, match="one shape"):
        native.gated_rms_norm_f32(torch.randn(2, 16), torch.randn(2, 8), torch.ones(16), 1e-6)
    with pytest.raises(ValueError, match="even"):
        native.silu_mul_f32(torch.randn(2, 15))


def test_rms_norm_leaves_prefill_and_other_dtypes_to_torch() -> None:
    scale = torch.ones(16)
    assert native.rms_norm_applies(torch.randn(native.CHUNK_MAX_ELEMENTS // 16, 16), scale)
    assert not native.rms_norm_applies(torch.randn(native.CHUNK_MAX_ELEMENTS // 16 + 1, 16), scale)
    assert not native.rms_norm_applies(torch.randn(4, 16, dtype=torch.bfloat16), scale)
    assert not native.rms_norm_applies(torch.randn(16, 4).t(), scale)
    assert native.row_stride(torch.randn(3, 4, 16)[:, ::2]) == 32  # every other row: still evenly spaced
    assert native.row_stride(torch.randn(4, 3, 16).transpose(0, 1)) is None
    with pytest.raises(ValueError, match="scale"):
        native.rms_norm_f32(torch.randn(2, 16), torch.ones(8), 1e-6)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 23, 32])
@pytest.mark.parametrize("shape", [(4096, 512), (70, 37), (3, 1)])
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8"])
def test_gemv_matches_torch(weights: str, shape: tuple[int, int], rows: int, threads: int,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Row groups of 8 and their remainders, inputs that are not a multiple of the vector width,
    fewer output features than threads, strided input rows (a slice of a wider activation); bfloat16
    and int8 weights against their float32 values."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(rows)
    weight, scales = torch.randn(*shape, generator=gen), None
    if weights == "bfloat16":
        weight = weight.bfloat16()
    elif weights == "int8":
        weight, scales = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8), torch.rand(shape[0]) + 0.5
    x = torch.randn(rows, shape[1] + 5, generator=gen)[:, 3:3 + shape[1]]
    assert native.gemv_applies(weight, x, native.GEMV_MAX_INPUT_ROWS)
    assert native.gemv_applies(weight, x) == (rows <= native.GEMV_DECODE_ROWS)
    y = native.gemv(weight, x, scales)
    assert y.shape == (rows, shape[0]) and y.is_contiguous()
    expected = x @ weight.float().t() * (scales if scales is not None else 1.0)
    torch.testing.assert_close(y, expected, atol=1e-4 * (128 if weights == "int8" else 1), rtol=1e-4)


def _instruction_sets() -> list[str]:
    """-march levels this CPU runs besides `native`: the generic x86-64 baseline (SSE2) and
    x86-64-v3 (AVX2, FMA) always, x86-64-v4 (AVX-512) where the CPU has it."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    levels = ["x86-64"] + (["x86-64-v3"] if " avx2" in flags and " fma" in flags else [])
    return levels + (["x86-64-v4"] if " avx512f" in flags and " avx512bw" in flags else [])


class _PartialLibrary:
    """A library built from some of csrc/'s sources: each function bound, when first asked for,
    with its signature in the kernels header (as `native._library()` binds the whole library)."""

    def __init__(self, cdll: ctypes.CDLL) -> None:
        self.cdll = cdll

    def __getattr__(self, name: str) -> Any:
        function = kernel_abi.bind(self.cdll, name)
        setattr(self, name, function)
        return function


def _compile_for(march: str, sources: list[str], tmp_path: Path) -> _PartialLibrary:
    """csrc/ `sources` (with the task pool) compiled alone for one -march level and loaded."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    flags = [flag for flag in native.CFLAGS if not flag.startswith("-march")]
    csrc = Path(native.__file__).with_name("csrc")
    library_path = tmp_path / f"{'-'.join(Path(source).stem for source in sources)}-{march}.so"
    subprocess.run([compiler, *flags, f"-march={march}", *(str(csrc / source) for source in sources),
                    str(csrc / "task_pool.c"), "-o", str(library_path), "-lpthread"],
                   check=True, capture_output=True, timeout=120)
    return _PartialLibrary(ctypes.CDLL(str(library_path)))


@needs_kernel
@pytest.mark.parametrize("march", _instruction_sets())
def test_gemv_matches_torch_on_every_vector_width(march: str, tmp_path: Path) -> None:
    """csrc/gemv.c picks its vector width and widening intrinsics by instruction set (AVX-512, AVX2
    or plain vectors); the kernel compiled for each level this CPU runs computes the same products,
    so a CI machine with another CPU runs tested code."""
    library = _compile_for(march, ["gemv.c"], tmp_path)
    gen = torch.Generator().manual_seed(5)
    assert library.gemv_preferred_rows() == (native.GEMV_MAX_INPUT_ROWS if march == "x86-64-v4" else 16)
    for rows, (out_features, in_features) in ((1, (67, 301)), (3, (130, 64)), (8, (9, 40)), (16, (70, 517)),
                                              (27, (33, 70))):
        x = torch.randn(rows, in_features + 3, generator=gen)[:, 2:2 + in_features]
        weight = torch.randn(out_features, in_features, generator=gen)
        int8 = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
        scales = torch.rand(out_features, generator=gen) + 0.5
        for kernel, w, expected in ((library.gemv_f32, weight, x @ weight.t()),
                                    (library.gemv_bf16, weight.bfloat16(), x @ weight.bfloat16().float().t()),
                                    (library.gemv_i8, int8, x @ int8.float().t() * scales)):
            y = torch.full((rows, out_features), float("nan"))
            args = [w.data_ptr(), out_features, in_features, x.data_ptr(), rows, x.stride(0), y.data_ptr(),
                    out_features, 2]
            if kernel is library.gemv_i8:
                args.insert(1, scales.data_ptr())
            assert kernel(*args) == 0
            torch.testing.assert_close(y, expected, atol=1e-4 * (128 if w.dtype == torch.int8 else 1), rtol=1e-4)


def _gemm_rows_available() -> bool:
    return native.native_kernels_enabled() and native.gemm_rows_bounds() != (0, 0)


@pytest.mark.skipif(not _gemm_rows_available(), reason="csrc/gemm_rows.c needs AVX-512 and the C kernels")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [6, 7, 16, 17, 23, 24, 64, 127, 128])
@pytest.mark.parametrize("shape", [(1552, 512), (70, 37), (3, 1), (5, 16), (130, 1536)])
def test_gemm_rows_matches_torch(shape: tuple[int, int], rows: int, threads: int,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of 4 weight rows x 6 input rows and their ragged ends on both sides, inputs that are
    not a multiple of 16 (the masked step), fewer output blocks than threads, strided input rows."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(*shape, generator=gen)
    x = torch.randn(rows, shape[1] + 5, generator=gen)[:, 3:3 + shape[1]]
    assert native.gemm_rows_applies(weight, x)
    y = native.gemm_rows(weight, x)
    assert y.shape == (rows, shape[0]) and y.is_contiguous()
    torch.testing.assert_close(y, x @ weight.t(), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not _gemm_rows_available(), reason="csrc/gemm_rows.c needs AVX-512 and the C kernels")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [6, 16, 23, 32])
@pytest.mark.parametrize("shape", [(1552, 512), (70, 37), (5, 16)])
def test_gemm_rows_int8_matches_torch(shape: tuple[int, int], rows: int, threads: int,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 weights widened in registers and scaled per output row, the linear and the MLP's
    silu(gate) * up, against the dequantized weight in float32; the wrong scales are refused."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(rows + shape[0])
    weight = torch.randint(-127, 128, (2 * shape[0], shape[1]), generator=gen, dtype=torch.int8)
    scales = torch.rand(2 * shape[0], generator=gen) * 0.002
    x = torch.randn(rows, shape[1] + 5, generator=gen)[:, 3:3 + shape[1]]
    assert native.gemm_rows_applies(weight, x)
    projection = x @ (weight.float() * scales[:, None]).t()
    torch.testing.assert_close(native.gemm_rows(weight, x, scales), projection, atol=1e-4, rtol=1e-4)
    gate, up = projection.chunk(2, dim=-1)
    torch.testing.assert_close(native.gemm_rows_silu_mul(weight, x, scales), F.silu(gate) * up, atol=1e-4,
                               rtol=1e-4)
    for wrong in (None, scales[1:]):
        with pytest.raises(ValueError, match="scales"):
            native.gemm_rows(weight, x, wrong)
    with pytest.raises(TypeError, match="scales must be float32"):  # another dtype: a TypeError
        native.gemm_rows(weight, x, scales.double())
    with pytest.raises(ValueError, match="scales"):
        native.gemm_rows(weight.float(), x, scales)
    with pytest.raises(TypeError, match="float32 or int8"):
        native.gemm_rows(weight.bfloat16(), x)


def _prefill_attention_available() -> bool:
    return native.native_kernels_enabled() and native.prefill_attention_max_tokens() > 0


@pytest.mark.skipif(not _prefill_attention_available(), reason="csrc/prefill_attention.c needs AVX-512")
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("tokens", "prefix", "heads", "kv_heads", "dim"),
                         [(64, 1000, 8, 2, 64), (1, 100, 8, 2, 64), (5, 0, 4, 1, 128), (17, 33, 16, 4, 256),
                          (64, 0, 8, 2, 64), (128, 63, 2, 2, 64), (3, 65, 6, 3, 192), (129, 0, 8, 2, 64),
                          (300, 77, 8, 2, 64), (700, 1200, 4, 1, 128)])
def test_prefill_attention_matches_the_eager_path(tokens: int, prefix: int, heads: int, kv_heads: int, dim: int,
                                                  threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys read in place through a scattered slot table against the gather + SDPA path: query
    groups, key blocks and their ragged ends, a chunk without a prefix, one query (the last layer's
    logit row), head sizes up to 256, long chunks in token blocks dealt to lanes (a block that
    starts past a row's bound is skipped for it)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(tokens + prefix)
    num_slots = prefix + tokens + 40
    cache_keys = torch.randn(num_slots, kv_heads, dim, generator=gen)
    cache_values = torch.randn(num_slots, kv_heads, dim, generator=gen)
    slots = torch.randperm(num_slots, generator=gen)[:prefix + tokens].contiguous()
    q = torch.randn(tokens, heads, dim, generator=gen) * 2
    assert native.prefill_attention_applies(q, cache_keys, slots)
    got = native.prefill_attention(q, cache_keys, cache_values, slots, dim ** -0.5)
    expected = prefill_attention(q, cache_keys[slots], cache_values[slots], prefix, dim ** -0.5)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_prefill_attention_leaves_other_inputs_to_torch() -> None:
    cache = torch.randn(300, 2, 64)
    slots = torch.arange(200)
    assert not native.prefill_attention_applies(torch.randn(301, 8, 64), cache, slots)  # more queries than slots
    assert not native.prefill_attention_applies(torch.randn(4, 8, 48), torch.randn(300, 2, 48), slots)  # head dim
    assert not native.prefill_attention_applies(torch.randn(4, 8, 128)[:, :, :64], cache, slots)  # strided heads
    assert not native.prefill_attention_applies(torch.randn(4, 8, 64).bfloat16(), cache, slots)
    assert not native.prefill_attention_applies(torch.randn(4, 8, 64), cache, slots.int())
    assert not native.prefill_attention_applies(torch.randn(4, 7, 64), cache, slots)  # heads not a multiple
    assert native.prefill_attention_applies(torch.randn(4, 8, 64), cache, slots) == _prefill_attention_available()
    if _prefill_attention_available():
        with pytest.raises(IndexError, match="slots"):
            native.prefill_attention(torch.randn(4, 8, 64), cache, cache.clone(), torch.tensor([0, 1, 2, 300]), 0.125)


@pytest.mark.skipif(not _gemm_rows_available(), reason="csrc/gemm_rows.c needs AVX-512 and the C kernels")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [6, 16, 17, 64, 128])
@pytest.mark.parametrize(("half", "in_features"), [(1536, 512), (200, 64), (33, 70), (5, 16)])
def test_gemm_rows_silu_mul_matches_torch(half: int, in_features: int, rows: int, threads: int,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The MLP's silu(gate) * up written by the GEMM: blocks of gate and up columns with their
    ragged ends, against the projection followed by torch's SiLU and product."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(half + rows)
    weight = torch.randn(2 * half, in_features, generator=gen) * 0.2
    x = torch.randn(rows, in_features + 3, generator=gen)[:, :in_features]
    fused = x @ weight.t()
    expected = F.silu(fused[:, :half]) * fused[:, half:]
    torch.testing.assert_close(native.gemm_rows_silu_mul(weight, x), expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="even"):
        native.gemm_rows_silu_mul(weight[1:], x)


def _gemm_rows_case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight, x, gemm_rows(weight, x)) for a seed, in whatever thread or process calls it."""
    gen = torch.Generator().manual_seed(seed)
    weight, x = torch.randn(300, 96, generator=gen), torch.randn(40, 96, generator=gen)
    return weight, x, native.gemm_rows(weight, x)


def _gemm_rows_in_child(seed: int) -> list[list[float]]:
    return _gemm_rows_case(seed)[2].tolist()  # a list: unpickling a tensor is torch's OpenMP work again


@pytest.mark.skipif(not _gemm_rows_available(), reason="csrc/gemm_rows.c needs AVX-512 and the C kernels")
def test_the_task_pool_serves_concurrent_callers_and_forked_children() -> None:
    """csrc/task_pool.c runs one call at a time: other threads calling in meanwhile run their tasks
    themselves; a child forked from a process whose pool is running starts its own workers. (The
    child computes nothing else with torch: after the parent's OpenMP work, torch's own parallel
    ops hang in a forked child, pickling a tensor included.)"""
    import multiprocessing
    import threading

    def check(seed: int, result: torch.Tensor) -> None:
        weight, x, _ = _gemm_rows_case(seed)
        torch.testing.assert_close(result, x @ weight.t(), atol=1e-4, rtol=1e-4)

    check(0, _gemm_rows_case(0)[2])  # the parent's workers are up
    results: list[tuple[int, torch.Tensor]] = []
    threads = [threading.Thread(target=lambda i=i: results.extend((i, _gemm_rows_case(i)[2]) for _ in range(200)))
               for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 600
    for seed, result in results[::37]:
        check(seed, result)
    with multiprocessing.get_context("fork").Pool(1) as pool:
        for seed, rows in enumerate(pool.map(_gemm_rows_in_child, range(10), chunksize=1)):
            check(seed, torch.tensor(rows))


def test_gemm_rows_leaves_other_inputs_to_torch() -> None:
    weight = torch.randn(8, 16)
    low, high = native.gemm_rows_bounds()
    assert (low, high) in ((0, 0), (6, 128))
    for rows in (1, 5, 129):
        assert not native.gemm_rows_applies(weight, torch.randn(rows, 16))
    assert not native.gemm_rows_applies(weight, torch.randn(16, 40).t())  # columns not contiguous
    assert not native.gemm_rows_applies(weight.bfloat16(), torch.randn(40, 16))
    assert not native.gemm_rows_applies(weight, torch.randn(40, 16).bfloat16())
    int8 = weight.to(torch.int8)
    assert not native.gemm_rows_applies(int8, torch.randn(native.GEMM_ROWS_INT8_MAX_ROWS + 1, 16))
    if _gemm_rows_available():
        assert native.gemm_rows_applies(int8, torch.randn(native.GEMM_ROWS_INT8_MAX_ROWS, 16))
    assert not native.gemm_rows_applies(weight.t().contiguous().t(), torch.randn(40, 16))
    if _gemm_rows_available():
        assert native.gemm_rows_applies(weight, torch.randn(40, 16))
        with pytest.raises(ValueError, match="columns"):
            native.gemm_rows(weight, torch.randn(40, 15))


@needs_kernel
@pytest.mark.parametrize("march", _instruction_sets())
def test_gemm_rows_builds_on_every_vector_width(march: str, tmp_path: Path) -> None:
    """csrc/gemm_rows.c and csrc/prefill_attention.c take work only where they are compiled for
    AVX-512; elsewhere they decline (no rows, no tokens, status 1) and the callers keep their other
    paths."""
    library = _compile_for(march, ["gemm_rows.c", "gemm_amx.c"], tmp_path)  # gemm_rows tries AMX first
    low, high = ctypes.c_int(), ctypes.c_int()
    library.gemm_rows_bounds(ctypes.byref(low), ctypes.byref(high))
    avx512 = march == "x86-64-v4"
    assert (low.value, high.value) == ((6, 128) if avx512 else (0, 0))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 70 + 3, generator=gen)[:, 2:72]
    weight = torch.randn(33, 70, generator=gen)
    y = torch.full((40, 33), float("nan"))
    status = library.gemm_rows(weight.data_ptr(), None, 0, 33, 70, x.data_ptr(), 40, x.stride(0), y.data_ptr(), 33, 2)
    assert status == (0 if avx512 else 1)
    if avx512:
        torch.testing.assert_close(y, x @ weight.t(), atol=1e-4, rtol=1e-4)
    else:
        assert torch.isnan(y).all()
    attention = _compile_for(march, ["prefill_attention.c"], tmp_path)
    assert attention.prefill_attention_max_tokens() == ((1 << 20) if avx512 else 0)


AMX_REASON = "csrc/gemm_amx.c needs a CPU and OS with AMX tiles"


def _amx_call(library: Any, weight: torch.Tensor, x: torch.Tensor, scales: torch.Tensor | None = None,
              silu: bool = False, threads: int = 2) -> tuple[int, torch.Tensor]:
    """gemm_amx (or gemm_amx_silu_mul) on a NaN-filled output: (status, output)."""
    out = weight.shape[0] // 2 if silu else weight.shape[0]
    y = torch.full((x.shape[0], out), float("nan"))
    kernel = library.gemm_amx_silu_mul if silu else library.gemm_amx
    status = kernel(weight.data_ptr(), scales.data_ptr() if scales is not None else None,
                    1 if weight.dtype == torch.int8 else 2, out, weight.shape[1], x.data_ptr(), x.shape[0],
                    x.stride(0), y.data_ptr(), out, threads)
    return status, y


def _amx_weight(dtype: str, shape: tuple[int, int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    if dtype == "int8":
        return (torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8),
                torch.rand(shape[0], generator=gen) * 0.01 + 0.001)
    return (torch.randn(*shape, generator=gen) * 0.05).bfloat16(), None


@pytest.mark.skipif(not native.amx_available(), reason=AMX_REASON)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [8, 9, 16, 17, 32])
@pytest.mark.parametrize("shape", [(1544, 512), (70, 37), (33, 1000), (5, 16), (48, 64)])
@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_gemm_amx_products_are_exact(dtype: str, shape: tuple[int, int], rows: int, threads: int) -> None:
    """bf16 or int8 weights on AMX tiles, float32 inputs split exactly into three bf16 parts: every
    product exact, so the error is float32 summation alone (<= 4e-7 of the sum of |terms|; two
    parts would give ~1.6e-6, one ~4e-3). Ragged ends on both sides (out not a multiple of 32, in
    not of 32), one or two groups of 16 input rows, strided rows; `gemv` (bf16) and `gemm_rows`
    (int8) take the same path."""
    gen = torch.Generator().manual_seed(rows * 7 + shape[1])
    weight, scales = _amx_weight(dtype, shape, gen)
    x = torch.randn(rows, shape[1] + 5, generator=gen)[:, 3:3 + shape[1]]
    status, y = _amx_call(native._library(), weight, x, scales, threads=threads)
    assert status == 0 and not torch.isnan(y).any()
    scale = scales.double() if scales is not None else 1.0
    exact = x.double() @ weight.double().t() * scale
    size = x.double().abs() @ weight.double().abs().t() * scale
    assert ((y.double() - exact).abs() / size).max() <= 4e-7
    same_path = native.gemv(weight, x) if dtype == "bfloat16" else native.gemm_rows(weight, x, scales)
    assert torch.equal(same_path, y)


@pytest.mark.skipif(not native.amx_available(), reason=AMX_REASON)
@pytest.mark.parametrize("rows", [8, 16, 20])
@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_gemm_amx_silu_mul_matches_float64(dtype: str, rows: int) -> None:
    """The MLP's variant: gate and up blocks of the fused [G; U] weight on tiles, silu(gate) * up
    written directly (an odd half, so the last block is ragged)."""
    gen = torch.Generator().manual_seed(rows)
    weight, scales = _amx_weight(dtype, (2 * 75, 96), gen)
    x = torch.randn(rows, 96, generator=gen)
    status, y = _amx_call(native._library(), weight, x, scales, silu=True)
    assert status == 0
    scale = scales.double() if scales is not None else 1.0
    projection = x.double() @ weight.double().t() * scale
    expected = F.silu(projection[:, :75]) * projection[:, 75:]
    torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)
    if dtype == "int8":
        assert torch.equal(native.gemm_rows_silu_mul(weight, x, scales), y)


@pytest.mark.skipif(not native.amx_available(), reason=AMX_REASON)
def test_gemm_amx_declines_other_rows_and_when_switched_off() -> None:
    """Outside 6..32 rows (bf16) or 8..32 (int8), or switched off, the AMX GEMM writes nothing and
    the GEMV or the float32 tile keeps those rows."""
    library = native._library()
    gen = torch.Generator().manual_seed(0)
    bf16, _ = _amx_weight("bfloat16", (40, 64), gen)
    int8, scales = _amx_weight("int8", (40, 64), gen)
    for weight, w_scales, declined in ((bf16, None, (1, 5, 33)), (int8, scales, (1, 7, 33))):
        for rows in declined:
            status, y = _amx_call(library, weight, torch.randn(rows, 64), w_scales)
            assert status == 1 and torch.isnan(y).all()
    status, y = _amx_call(library, int8, torch.randn(16, 64))  # int8 without scales
    assert status == 1 and torch.isnan(y).all()
    x = torch.randn(16, 64)
    assert native.set_amx(False)
    try:
        assert not native.amx_available()
        for weight, w_scales in ((bf16, None), (int8, scales)):
            status, y = _amx_call(library, weight, x, w_scales)
            assert status == 1 and torch.isnan(y).all()
        torch.testing.assert_close(native.gemv(bf16, x), x @ bf16.float().t(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(native.gemm_rows(int8, x, scales), x @ int8.float().t() * scales,
                                   atol=1e-5, rtol=1e-5)
    finally:
        native.set_amx(True)
    assert native.amx_available()


@needs_kernel
@pytest.mark.parametrize("march", _instruction_sets())
def test_gemm_amx_declines_without_amx(march: str, tmp_path: Path) -> None:
    """Built for a level without AMX tiles (x86-64 to x86-64-v4), csrc/gemm_amx.c takes nothing and
    reports none: the callers keep the GEMV and the float32 tile there."""
    library = _compile_for(march, ["gemm_amx.c"], tmp_path)
    assert library.gemm_amx_available() == 0
    gen = torch.Generator().manual_seed(1)
    for weight, scales in (_amx_weight("bfloat16", (40, 64), gen), _amx_weight("int8", (40, 64), gen)):
        for silu in (False, True):
            status, y = _amx_call(library, weight, torch.randn(16, 64), scales, silu=silu)
            assert status == 1 and torch.isnan(y).all()


def test_gemv_leaves_other_inputs_to_torch() -> None:
    weight = torch.randn(8, 16)
    assert not native.gemv_applies(weight, torch.randn(native.GEMV_MAX_INPUT_ROWS + 1, 16))
    assert not native.gemv_applies(weight, torch.randn(native.GEMV_MAX_INPUT_ROWS + 1, 16), 1000)
    assert not native.gemv_applies(weight, torch.randn(0, 16))
    assert not native.gemv_applies(weight, torch.randn(16, 2).t())  # columns not contiguous
    assert not native.gemv_applies(weight.t().contiguous().t(), torch.randn(2, 16))
    assert not native.gemv_applies(weight, torch.randn(2, 16).bfloat16())  # rows must be float32
    if native.native_kernels_enabled():
        with pytest.raises(ValueError, match="columns"):
            native.gemv(weight, torch.randn(2, 15))
        with pytest.raises(ValueError, match="scales"):
            native.gemv(weight.to(torch.int8), torch.randn(2, 16))
        with pytest.raises(ValueError, match="rows"):
            native.gemv(weight, torch.randn(native.GEMV_MAX_INPUT_ROWS + 1, 16))


@needs_kernel
def test_a_slot_out_of_range_is_rejected_before_any_state_changes() -> None:
    layer = _Layer()
    layer.slots = torch.tensor([0, 1, layer.rec_live.shape[0]])
    before = layer.rec_live.clone()
    with pytest.raises(IndexError, match="outside"):
        layer.fused(in_place=True)
    assert torch.equal(layer.rec_live, before)
    layer.slots = torch.tensor([0, 1, 2])
    with pytest.raises(TypeError, match="proj must be float32"):
        native.gdn_decode_f32(layer.projection.double(), layer.b_offset, layer.b_offset + layer.hv,
                              layer.slots, layer.conv_live, layer.rec_live, layer.weight, layer.dt_bias,
                              layer.neg_decay_rate, layer.hk, L2_NORM_EPS)
    with pytest.raises(ValueError, match="disagree"):  # gate columns past the end of the projection row
        native.gdn_decode_f32(layer.projection, layer.b_offset + 1, layer.b_offset + layer.hv + 1,
                              layer.slots, layer.conv_live, layer.rec_live, layer.weight, layer.dt_bias,
                              layer.neg_decay_rate, layer.hk, L2_NORM_EPS)
    with pytest.raises(ValueError, match="disagree"):  # fewer slots than rows
        native.gdn_decode_f32(layer.projection, layer.b_offset, layer.b_offset + layer.hv, layer.slots[:2],
                              layer.conv_live, layer.rec_live, layer.weight, layer.dt_bias,
                              layer.neg_decay_rate, layer.hk, L2_NORM_EPS)
    assert torch.equal(layer.rec_live, before)


def _engine(**cache: object) -> LLMEngine:
    return LLMEngine(EngineConfig(device="cpu", dtype="float32", cache=CacheConfig(kv_cache_mib=8, **cache)))


PROMPTS = {"a": list(range(300, 340)), "b": [7, 8, 9] * 11, "c": list(range(1000, 1100))}


def test_greedy_tokens_are_identical_with_the_kernel_on_and_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three sequences decode together; snapshots every 16 tokens are captured on the decode path
    and restored by the warm repeat, so captures from the in-place update are checked too."""
    results = []
    for enabled in ("1", "0"):
        monkeypatch.setenv(native.NATIVE_KERNELS_ENV, enabled)
        engine = _engine(snapshot_interval=16, block_size=16)
        cold = run_greedy(engine, PROMPTS)
        warm = run_greedy(engine, {f"{k}-again": p + list(cold[k].token_ids[:20]) for k, p in PROMPTS.items()})
        results.append((cold, warm))
    assert results[0] == results[1]
    assert all(run.num_cached_tokens > 0 for run in results[0][1].values())


@needs_kernel
def test_a_forward_failing_after_an_in_place_update_leaves_no_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Module path: the final norm runs after every GDN layer updated its live slots in place;
    failing it once mid-decode must restore those slots, so the retried step gives the tokens of an
    unfailed run."""
    monkeypatch.setenv(one_call_step.ONE_CALL_STEP_ENV, "0")
    expected = run_greedy(_engine(prefix_cache_mib=0), PROMPTS)
    engine = _engine(prefix_cache_mib=0)
    norm, calls = engine.runner.model.model.norm, {"n": 0}
    original = norm.forward

    def failing_once(x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 6:  # a decode step of all three sequences
            raise RuntimeError("injected failure after the GDN layers")
        return original(x)

    monkeypatch.setattr(norm, "forward", failing_once)
    assert run_greedy(engine, PROMPTS) == expected
    assert calls["n"] > 6


@needs_kernel
@pytest.mark.parametrize("kept_bytes", [one_call_step._StepBuffers.KEPT_BYTES, 0], ids=["kept", "per-step"])
def test_a_fused_decode_step_failing_after_it_ran_leaves_no_trace(kept_bytes: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Fused path: the C step updated every GDN slot in place and then the forward fails; the undo
    record it handed over restores the slots, and the retried step gives an unfailed run's tokens.
    Its buffers are kept from step to step, or (past KEPT_BYTES) allocated for each step."""
    expected = run_greedy(_engine(prefix_cache_mib=0), PROMPTS)
    monkeypatch.setattr(one_call_step._StepBuffers, "KEPT_BYTES", kept_bytes)
    engine = _engine(prefix_cache_mib=0)
    calls, original = {"n": 0}, one_call_step.OneCallStep.run

    def failing_once(self: one_call_step.OneCallStep, batch: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
        logits = original(self, batch, ctx)
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure after the fused decode step")
        return logits

    monkeypatch.setattr(one_call_step.OneCallStep, "run", failing_once)
    assert run_greedy(engine, PROMPTS) == expected
    assert calls["n"] > 3


def test_without_a_compiler_the_eager_path_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_compiler", lambda: None)
    native._library.cache_clear()
    try:
        assert not native.native_kernels_enabled()
        expected_ids = run_greedy(_engine(prefix_cache_mib=0), {"a": PROMPTS["a"]}, max_tokens=8)
        assert len(expected_ids["a"].token_ids) == 8
    finally:
        monkeypatch.undo()
        native._library.cache_clear()


@needs_kernel
@pytest.mark.parametrize("vocab", [1, 15, 16, 37, 4096])
def test_argmax_and_finite_match_torch(vocab: int) -> None:
    """The sampler's one-pass row summary: torch's argmax (the first of tied maxima) and
    isfinite().all() per row, for rows with NaN, +inf or -inf anywhere, rows `ld` apart."""
    gen = torch.Generator().manual_seed(vocab)
    wide = torch.randn(9, vocab + 3, generator=gen)
    logits = wide[:, 1:1 + vocab]
    logits[1] = 0.5  # all tied: the first index
    logits[2, vocab // 2] = float("nan")
    logits[3, -1] = float("inf")
    logits[4, 0] = float("-inf")
    logits[5, vocab // 3:] = logits[5].max() + 1.0  # a tie of the later maxima
    logits[6, -1] = float("nan")
    summary = native.argmax_and_finite(logits)
    assert summary is not None
    argmax, finite = summary
    expected_finite = torch.isfinite(logits).all(dim=-1).tolist()
    assert finite == expected_finite
    expected_argmax = logits.argmax(dim=-1).tolist()
    assert [a for a, ok in zip(argmax, finite) if ok] == [a for a, ok in zip(expected_argmax, finite) if ok]
    assert all(0 <= a < vocab for a in argmax)


def test_argmax_and_finite_leave_other_tensors_to_torch() -> None:
    assert native.argmax_and_finite(torch.randn(2, 8).double()) is None
    assert native.argmax_and_finite(torch.randn(8, 2).t()) is None  # columns not contiguous
    assert native.argmax_and_finite(torch.randn(2, 0)) is None
    assert native.argmax_and_finite(torch.randn(8)) is None


# ---- The kernel interface: one header, bindings and struct mirrors from it, checked at load ----

def _library_or_skip() -> kernel_abi.KernelLibrary:
    library = native._library()
    if library is None:
        pytest.skip("no C compiler: the eager path is used")
    return library


def test_the_header_parser_reads_prototypes_structs_and_constants() -> None:
    abi = kernel_abi.parse_header("""
        #include <stdint.h>
        /* a comment; with a semicolon */
        enum { FORMAT_A = 0, FORMAT_B = -3 };
        typedef struct { const float *a, **b; int64_t n; } Inner;
        typedef struct { Inner inner; const Inner *many; float eps; } Outer;
        int64_t size_of(const Outer *outer, int threads);  // trailing comment
        void nothing(void);
    """)
    assert abi.constants == {"FORMAT_A": 0, "FORMAT_B": -3}
    assert [(f.base, f.pointers, f.name) for f in abi.structs["Inner"]] == [("float", 1, "a"), ("float", 2, "b"),
                                                                           ("int64_t", 0, "n")]
    assert [f.c_type() for f in abi.structs["Outer"]] == ["Inner", "Inner *", "float"]
    size_of = abi.functions["size_of"]
    assert size_of.result.c_type() == "int64_t"
    assert [(p.c_type(), p.name) for p in size_of.params] == [("Outer *", "outer"), ("int", "threads")]
    assert abi.functions["nothing"].params == ()
    function = kernel_abi.function_type(size_of)
    assert function._argtypes_ == (ctypes.c_void_p, ctypes.c_int) and function._restype_ is ctypes.c_int64


@pytest.mark.parametrize(("text", "problem"), [
    ("long weird(int x);", "unknown type"),
    ("int unnamed(int);", "declarator"),
    ("enum { A };", "explicit value"),
    ("int twice(void); int twice(void);", "declared twice"),
    ("int missing_semicolon(void)", "after the last"),
    ("typedef struct { unsigned short x; } S;", "unknown type"),
])
def test_the_header_parser_rejects_what_it_cannot_read(text: str, problem: str) -> None:
    with pytest.raises(kernel_abi.KernelAbiError, match=problem):
        kernel_abi.parse_header(text)


def test_the_kernels_header_declares_the_bound_functions_and_shared_structs() -> None:
    abi = kernel_abi.header_abi()
    assert set(abi.structs) == set(kernel_abi.MIRRORS) == {"Linear", "DecodeLayer", "DecodeModel"}
    gdn = abi.functions["gdn_decode_f32"]
    assert len(gdn.params) == 26 and gdn.result.c_type() == "int"
    assert [p.name for p in gdn.params[:3]] == ["batch", "num_k_heads", "num_v_heads"]
    for name, mirror in kernel_abi.MIRRORS.items():  # the mirrors take their fields from the header, in order
        assert [field[0] for field in mirror._fields_] == [field.name for field in abi.structs[name]]
    assert kernel_abi.WEIGHT_FORMATS == {torch.float32: 0, torch.int8: 1, torch.bfloat16: 2}


@needs_kernel
def test_every_declared_function_is_bound_with_its_arity_and_types() -> None:
    library = _library_or_skip()
    for name, prototype in kernel_abi.header_abi().functions.items():
        function = getattr(library, name)
        assert len(function.argtypes) == len(prototype.params), name
        for param, argtype in zip(prototype.params, function.argtypes):
            assert argtype is (ctypes.c_void_p if param.pointers else getattr(ctypes, {
                "int": "c_int", "float": "c_float", "int64_t": "c_int64"}[param.base])), (name, param)
    with pytest.raises(TypeError, match="takes 0 arguments"):
        library.gemv_preferred_rows(1)
    with pytest.raises(TypeError, match="takes 8 arguments"):  # one too many: ctypes' cdecl default passes it on
        library.rms_norm_f32(0, 0, 0, 0, 0, 1e-6, 0, 0, 0)
    with pytest.raises(AttributeError, match="declares no function"):
        library.not_a_kernel  # noqa: B018 (the attribute access is the test)


@needs_kernel
def test_every_exported_function_is_declared_in_the_header() -> None:
    """The library exports the header's functions and, besides them, only the task pool's entry
    point (declared in task_pool.h, called by the kernels alone)."""
    library = _library_or_skip()
    if shutil.which("nm") is None:
        pytest.skip("no nm to list the library's symbols")
    listing = subprocess.run(["nm", "-D", "--defined-only", str(library.path)], check=True, capture_output=True,
                             text=True).stdout
    exported = {line.split()[2] for line in listing.splitlines() if len(line.split()) == 3
                and line.split()[1] == "T"}
    assert exported - set(kernel_abi.header_abi().functions) == {"task_pool_run"}
    assert set(kernel_abi.header_abi().functions) <= exported


@needs_kernel
def test_the_struct_mirrors_match_the_compiled_layout() -> None:
    library = _library_or_skip()
    assert kernel_abi.layout_problems(library) == []
    for name, mirror in kernel_abi.MIRRORS.items():
        assert library.kernel_abi_struct_size(name.encode()) == ctypes.sizeof(mirror)
    assert library.kernel_abi_struct_size(b"NoSuchStruct") == -1
    assert library.kernel_abi_field_offset(b"DecodeModel", b"layers") == kernel_abi.DecodeModel.layers.offset
    assert library.kernel_abi_field_size(b"DecodeModel", b"rms_eps") == 4


class _NarrowFormat(ctypes.Structure):
    _fields_ = [("weight", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("format", ctypes.c_int32)]


class _SwappedPointers(ctypes.Structure):
    _fields_ = [("scales", ctypes.c_void_p), ("weight", ctypes.c_void_p), ("format", ctypes.c_int64)]


class _MissingFormat(ctypes.Structure):
    _fields_ = [("weight", ctypes.c_void_p), ("scales", ctypes.c_void_p)]


@needs_kernel
@pytest.mark.parametrize(("mirror", "problems"), [
    (_NarrowFormat, ["sizeof(Linear.format): 8 compiled, 4 in the mirror"]),
    (_SwappedPointers, ["offsetof(Linear, weight): 0 compiled, 8 in the mirror",
                        "offsetof(Linear, scales): 8 compiled, 0 in the mirror"]),
    (_MissingFormat, ["sizeof(Linear): 24 compiled, 16 in the ctypes mirror",
                      "Linear.format is declared in hybridserve_kernels.h but not in the ctypes mirror"]),
])
def test_a_mirror_that_differs_from_the_compiled_struct_is_reported(mirror: type[ctypes.Structure],
                                                                    problems: list[str]) -> None:
    library = _library_or_skip()
    assert kernel_abi.layout_problems(library, mirrors={**kernel_abi.MIRRORS, "Linear": mirror}) == problems
    missing = kernel_abi.layout_problems(library, mirrors={"Linear": kernel_abi.Linear})
    assert missing == [f"struct {name} is declared in hybridserve_kernels.h but has no ctypes mirror"
                       for name in ("DecodeLayer", "DecodeModel")]


@needs_kernel
def test_an_interface_mismatch_disables_the_kernels(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A mirror that does not match the compiled struct (or a declared function the library lacks)
    is an error at load: the kernels are off and every caller keeps the PyTorch ops."""
    library = _library_or_skip()
    monkeypatch.setitem(kernel_abi.MIRRORS, "Linear", _NarrowFormat)
    native._library.cache_clear()
    try:
        assert native._library() is None and not native.native_kernels_enabled()
        assert "do not match their interface" in caplog.text and "Linear.format" in caplog.text
        assert not native.rms_norm_applies(torch.randn(2, 16), torch.ones(16))
        assert not native.gemv_applies(torch.randn(8, 16), torch.randn(2, 16))
        with pytest.raises(RuntimeError, match="unavailable"):
            native.rms_norm_f32(torch.randn(2, 16), torch.ones(16), 1e-6)
    finally:
        monkeypatch.undo()
        native._library.cache_clear()
    abi = kernel_abi.header_abi()
    extra = kernel_abi.parse_header("int not_exported(int x);").functions
    with pytest.raises(kernel_abi.KernelAbiError, match="does not export not_exported"):
        kernel_abi.KernelLibrary(library.path, kernel_abi.HeaderAbi({**abi.functions, **extra}, abi.structs,
                                                                     abi.constants))
    assert native.native_kernels_enabled()


def _compile_probe(source: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`source` (next to the kernels header) compiled with the kernels' flags."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    assert compiler is not None
    csrc = Path(native.__file__).with_name("csrc")
    probe = tmp_path / "probe.c"
    probe.write_text(source)
    return subprocess.run([compiler, *native.CFLAGS, f"-I{csrc}", str(probe), "-o", str(tmp_path / "probe.so")],
                          check=False, capture_output=True, text=True, timeout=120)


@needs_kernel
def test_a_definition_that_differs_from_the_header_does_not_compile(tmp_path: Path) -> None:
    """The build's -Wmissing-prototypes -Werror: an exported function the header does not declare,
    or one defined with another signature than declared, fails the build (the kernels then stay
    off) instead of being called with the wrong arguments."""
    assert {"-Wall", "-Wextra", "-Werror", "-Wmissing-prototypes"} <= set(native.CFLAGS)
    declared = '#include "hybridserve_kernels.h"\nint gemv_preferred_rows(void) { return 16; }\n'
    assert _compile_probe(declared, tmp_path).returncode == 0
    changed = '#include "hybridserve_kernels.h"\nint gemv_preferred_rows(int rows) { return rows; }\n'
    assert "conflicting types" in _compile_probe(changed, tmp_path).stderr
    undeclared = '#include "hybridserve_kernels.h"\nint exported_without_declaration(void) { return 0; }\n'
    assert "no previous prototype" in _compile_probe(undeclared, tmp_path).stderr
    unused = '#include "hybridserve_kernels.h"\nint gemv_preferred_rows(void) { int unused; return 16; }\n'
    assert _compile_probe(unused, tmp_path).returncode != 0


def test_the_build_is_keyed_by_its_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Changing a compiler flag (a warning made an error, say) builds a new library rather than
    loading one built with the old flags."""
    if native._compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built: list[Path] = []
    monkeypatch.setattr(native, "_build", lambda compiler, target: built.append(target))
    first = native._compiled_library()
    monkeypatch.setattr(native, "CFLAGS", [*native.CFLAGS, "-Wconversion"])
    second = native._compiled_library()
    assert first is not None and second is not None and first != second and built == [first, second]


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta")


_W, _X = torch.randn(8, 16), torch.randn(2, 16)
_INT8, _SCALES = torch.randint(-5, 5, (8, 16), dtype=torch.int8), torch.rand(8)
_LAYER = _Layer()


def _gdn_decode(**changed: object) -> object:
    args = {"proj": _LAYER.projection, "b_offset": _LAYER.b_offset, "a_offset": _LAYER.b_offset + _LAYER.hv,
            "slots": _LAYER.slots, "conv_live": _LAYER.conv_live, "rec_live": _LAYER.rec_live,
            "conv_weight": _LAYER.weight, "dt_bias": _LAYER.dt_bias, "neg_decay_rate": _LAYER.neg_decay_rate,
            "num_k_heads": _LAYER.hk, "l2_eps": L2_NORM_EPS}
    return native.gdn_decode_f32(**{**args, **changed})  # type: ignore[arg-type]


def _gdn_prefill(**changed: object) -> object:
    hk, hv, dk, dv, kernel = 1, 2, 4, 4, 4
    conv_dim = 2 * hk * dk + hv * dv
    args = {"x": torch.randn(5, conv_dim), "conv_state": torch.randn(conv_dim, kernel - 1), "g": torch.randn(5, hv),
            "beta": torch.rand(5, hv), "rec_state": torch.randn(hv, dk, dv),
            "conv_weight": torch.randn(conv_dim, kernel), "num_k_heads": hk, "l2_eps": L2_NORM_EPS,
            "capture_tokens": []}
    return native.gdn_prefill_f32(**{**args, **changed})  # type: ignore[arg-type]


_ROPE_X, _ROPE_COS = torch.randn(3, 2, 8), torch.randn(3, 1, 4)
_CACHE, _SLOTS = torch.randn(20, 2, 64), torch.arange(6)

# (call, exception, message): each wrapper rejects a wrong dtype, device, layout or shape itself,
# before any pointer reaches C (with or without the compiled kernels).
WRONG_INPUTS = {
    "rms_norm x dtype": (lambda: native.rms_norm_f32(_X.double(), torch.ones(16), 1e-6), TypeError,
                         "rms_norm_f32: x must be float32, got float64"),
    "rms_norm x not a tensor": (lambda: native.rms_norm_f32([1.0], torch.ones(1), 1e-6), TypeError,
                                "x must be a tensor"),
    "rms_norm x device": (lambda: native.rms_norm_f32(_meta(2, 16), torch.ones(16), 1e-6), ValueError,
                          "x must be on the CPU"),
    "rms_norm rows": (lambda: native.rms_norm_f32(torch.randn(4, 3, 16).transpose(0, 1), torch.ones(16), 1e-6),
                      ValueError, "evenly spaced"),
    "rms_norm scale shape": (lambda: native.rms_norm_f32(_X, torch.ones(8), 1e-6), ValueError,
                             r"scale must have shape \(16,\)"),
    "rms_norm scale layout": (lambda: native.rms_norm_f32(_X, torch.ones(32)[::2], 1e-6), ValueError,
                              "scale must be contiguous"),
    "norm_rope x dims": (lambda: native.rms_norm_rope_f32(_X, torch.ones(16), 1e-6, _ROPE_COS, _ROPE_COS),
                         ValueError, "x must have 3 dimensions"),
    "norm_rope x columns": (lambda: native.rms_norm_rope_f32(torch.randn(3, 2, 16)[:, :, ::2], torch.ones(8), 1e-6,
                                                             _ROPE_COS, _ROPE_COS), ValueError, "contiguous rows"),
    "norm_rope cos shape": (lambda: native.rms_norm_rope_f32(_ROPE_X, torch.ones(8), 1e-6, torch.randn(2, 1, 4),
                                                             torch.randn(2, 1, 4)), ValueError, "cos must have shape"),
    "norm_rope sin dtype": (lambda: native.rms_norm_rope_f32(_ROPE_X, torch.ones(8), 1e-6, _ROPE_COS,
                                                             _ROPE_COS.bfloat16()), TypeError, "sin must be float32"),
    "norm_rope odd rotary": (lambda: native.rms_norm_rope_f32(_ROPE_X, torch.ones(8), 1e-6, torch.randn(3, 1, 3),
                                                              torch.randn(3, 1, 3)), ValueError, "must be even"),
    "gated_norm gate dtype": (lambda: native.gated_rms_norm_f32(_X, _X.bfloat16(), torch.ones(16), 1e-6), TypeError,
                              "gate must be float32"),
    "gated_norm gate rows": (lambda: native.gated_rms_norm_f32(torch.randn(2, 2, 16), torch.randn(2, 2, 16)
                                                               .transpose(0, 1), torch.ones(16), 1e-6),
                             ValueError, "gate must have contiguous, evenly spaced rows"),
    "silu_mul dtype": (lambda: native.silu_mul_f32(torch.ones(2, 16, dtype=torch.int32)), TypeError,
                       "x must be float32, got int32"),
    "silu_mul columns": (lambda: native.silu_mul_f32(torch.randn(16, 4).t()), ValueError, "evenly spaced"),
    "silu_mul scalar": (lambda: native.silu_mul_f32(torch.tensor(1.0)), ValueError, "even and non-zero"),
    "gemv weight dtype": (lambda: native.gemv(_W.double(), _X), TypeError,
                          "gemv: weight must be float32 or bfloat16 or int8, got float64"),
    "gemv weight layout": (lambda: native.gemv(torch.randn(16, 8).t(), _X), ValueError,
                           "weight must be contiguous"),
    "gemv weight dims": (lambda: native.gemv(torch.randn(16), _X), ValueError, "weight must have 2 dimensions"),
    "gemv x dtype": (lambda: native.gemv(_W, _X.bfloat16()), TypeError, "x must be float32, got bfloat16"),
    "gemv x columns": (lambda: native.gemv(_W, torch.randn(32, 2).t()[:, :16]), ValueError, "contiguous rows"),
    "gemv x device": (lambda: native.gemv(_W, _meta(2, 16)), ValueError, "x must be on the CPU"),
    "gemv scales on float32": (lambda: native.gemv(_W, _X, _SCALES), ValueError, "int8 weights only"),
    "gemv scales dtype": (lambda: native.gemv(_INT8, _X, _SCALES.double()), TypeError, "scales must be float32"),
    "gemv scales shape": (lambda: native.gemv(_INT8, _X, torch.rand(7)), ValueError, r"scales must have shape \(8,\)"),
    "gemm_rows weight dtype": (lambda: native.gemm_rows(_W.bfloat16(), torch.randn(8, 16)), TypeError,
                               "gemm_rows: weight must be float32 or int8, got bfloat16"),
    "gemm_rows x columns": (lambda: native.gemm_rows(_W, torch.randn(8, 15)), ValueError, "15 columns"),
    "gemm_rows int8 without scales": (lambda: native.gemm_rows(_INT8, torch.randn(8, 16)), ValueError,
                                      "need contiguous float32 scales"),
    "gemm_rows_silu_mul odd": (lambda: native.gemm_rows_silu_mul(_W[1:], torch.randn(8, 16)), ValueError,
                               "even number of rows"),
    "gemm_rows_silu_mul x dims": (lambda: native.gemm_rows_silu_mul(_W, torch.randn(8)), ValueError,
                                  "x must have 2 dimensions"),
    "prefill_attention q dtype": (lambda: native.prefill_attention(torch.randn(4, 4, 64).bfloat16(), _CACHE, _CACHE,
                                                                   _SLOTS, 0.125), TypeError, "q must be float32"),
    "prefill_attention q heads": (lambda: native.prefill_attention(torch.randn(4, 8, 64)[:, ::2], _CACHE, _CACHE,
                                                                   _SLOTS, 0.125), ValueError, "heads of q"),
    "prefill_attention slots dtype": (lambda: native.prefill_attention(torch.randn(4, 4, 64), _CACHE, _CACHE,
                                                                       _SLOTS.int(), 0.125), TypeError,
                                      "slots must be int64"),
    "prefill_attention slots layout": (lambda: native.prefill_attention(torch.randn(4, 4, 64), _CACHE, _CACHE,
                                                                        torch.arange(12)[::2], 0.125), ValueError,
                                       "slots must be contiguous"),
    "prefill_attention too few slots": (lambda: native.prefill_attention(torch.randn(4, 4, 64), _CACHE, _CACHE,
                                                                         _SLOTS[:3], 0.125), ValueError,
                                        "3 slots for 4"),
    "prefill_attention values layout": (lambda: native.prefill_attention(torch.randn(4, 4, 64), _CACHE,
                                                                         torch.randn(64, 2, 20).permute(2, 1, 0),
                                                                         _SLOTS, 0.125), ValueError,
                                        "cache_values must be contiguous"),
    "gdn_decode slots dtype": (lambda: _gdn_decode(slots=_LAYER.slots.int()), TypeError, "slots must be int64"),
    "gdn_decode state layout": (lambda: _gdn_decode(rec_live=_LAYER.rec_live.transpose(2, 3)), ValueError,
                                "rec_live must be contiguous"),
    "gdn_decode state dims": (lambda: _gdn_decode(conv_live=_LAYER.conv_live[0]), ValueError,
                              "conv_live must have 3 dimensions"),
    "gdn_decode proj columns": (lambda: _gdn_decode(proj=_LAYER.projection.t().contiguous().t()), ValueError,
                                "proj must have contiguous rows"),
    "gdn_decode norm dtype": (lambda: _gdn_decode(norm_weight=torch.ones(_LAYER.dv).double()), TypeError,
                              "norm_weight must be float32"),
    "gdn_decode norm shape": (lambda: _gdn_decode(norm_weight=torch.ones(_LAYER.dv + 1)), ValueError, "disagree"),
    "gdn_prefill x dtype": (lambda: _gdn_prefill(x=torch.randn(5, 24).double()), TypeError, "x must be float32"),
    "gdn_prefill gates layout": (lambda: _gdn_prefill(g=torch.randn(2, 5).t()), ValueError, "g must be contiguous"),
    "gdn_prefill state dims": (lambda: _gdn_prefill(rec_state=torch.randn(2, 4, 4, 1)), ValueError,
                               "rec_state must have 3 dimensions"),
    "decode step ids": (lambda: native.check_index_tensors("decode_step_f32", tokens=torch.zeros(3, dtype=torch.int32)),
                        TypeError, "decode_step_f32: tokens must be int64"),
    "decode step tables": (lambda: native.check_index_tensors("decode_step_f32",
                                                              block_tables=torch.zeros(4, 3, dtype=torch.long).t()),
                           ValueError, "block_tables must be contiguous"),
}


@pytest.mark.parametrize("case", list(WRONG_INPUTS))
def test_each_wrapper_rejects_wrong_inputs_with_a_clear_error(case: str) -> None:
    call, exception, message = WRONG_INPUTS[case]
    with pytest.raises(exception, match=message):
        call()


def test_no_assert_guards_a_kernel_call() -> None:
    """Runtime checks in the wrappers and the C step's caller raise; `python -O` strips asserts."""
    for module in (native, kernel_abi, one_call_step):
        tree = ast.parse(Path(module.__file__).read_text())
        assert not [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)], module.__name__

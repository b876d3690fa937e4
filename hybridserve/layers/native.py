"""Small fused CPU kernels in C, compiled on first use and called through ctypes.

A batch-1 decode step on CPU is bound by per-op dispatch, and a batch-16 one by passes over the GDN
state: the eager GDN decode runs ~25 ATen ops per layer and reads and writes each sequence's
recurrent state five times. `gdn_decode_f32` (csrc/gdn_decode.c) does the whole step of one layer,
output norm included, in one call and one pass; `rms_norm_f32` (csrc/rms_norm.c) replaces the six
ops of torch's CPU rms_norm for decode-sized inputs, and csrc/elementwise.c does the attention's
q/k norm + rotary and, on short chunks, the GDN output norm with its SiLU gate and the MLP's
silu(gate) * up. `gdn_prefill_f32` (csrc/gdn_prefill.c) runs a prefill chunk through a GDN layer
token by token: on CPU that beats the chunked form's matrix products at every length measured
(see the source's header). csrc/delta_rule.h holds the delta-rule step both GDN kernels share,
csrc/vector_math.h an exp that GCC vectorises and the denormal flush the kernels using it set.
`gemv` (csrc/gemv.c) is the linear (float32, bfloat16 or int8 weights, float32 rows) for up to
16 rows, written to stream each weight as fast as a plain read (see linear.py), and `gemm_rows`
(csrc/gemm_rows.c) the one for 6 to 128 rows on AVX-512 (float32 weights; int8 up to 32 rows),
which comes first where it applies; where the CPU has AMX tiles, bfloat16 weights take them from
6 to 32 rows and int8 ones from 8 (csrc/gemm_amx.c; `HYBRIDSERVE_AMX=0` turns that off);
`prefill_attention` (csrc/prefill_attention.c) attends a short chunk over the paged KV in place;
csrc/decode_step.c runs a whole decode step (see models/fused_decode.py). The sources are compiled
with the system C compiler into the user's cache directory (keyed by sources, compiler and CPU, so
a home shared by different CPUs is safe) and loaded with ctypes: no build step at install, about
3 s at the first start on the 2-core VM, nothing after. The kernels' parallel work runs on their own task pool (csrc/task_pool.c), whose
caller never waits for a worker that has not started; the one OpenMP loop left (logits.c) binds to
the `libgomp.so.1` torch already loaded. Without a compiler, on other devices or dtypes, or with
`HYBRIDSERVE_NATIVE_KERNELS=0`, callers fall back to the eager PyTorch ops (see
`native_kernels_enabled`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

NATIVE_KERNELS_ENV = "HYBRIDSERVE_NATIVE_KERNELS"
AMX_ENV = "HYBRIDSERVE_AMX"  # 0: bf16 and int8 rows keep the GEMV / float32 tile where the CPU has AMX
SOURCES = sorted((Path(__file__).with_name("csrc")).glob("*.c"))
# elements the single-threaded elementwise kernels (norms, gates) take: decode rows and short chunks
# (the fused MLP output of a 64-token chunk of the built-in model: 64 x 3072). There each of torch's
# ops is a parallel region that waits for a sleeping OpenMP worker; a longer chunk is worth them.
CHUNK_MAX_ELEMENTS = 1 << 18
HEADERS = sorted((Path(__file__).with_name("csrc")).glob("*.h"))
# -fno-trapping-math lets GCC vectorise the branches of vector_math.h's exp; like -fno-math-errno it
# changes no result (no -ffast-math: sums keep their order)
CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]

_i64 = ctypes.c_int64
_ptr, _float, _int = ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_GDN_DECODE_ARGTYPES = [_i64] * 6 + [_ptr, _i64, _i64, _i64, _ptr, _i64] + [_ptr] * 5 \
    + [_float, _ptr, _float, _int, _int] + [_ptr] * 4
_GDN_PREFILL_ARGTYPES = [_i64] * 6 + [_ptr, _i64] + [_ptr] * 5 + [_float, _i64, _ptr, _int] + [_ptr] * 4
_RMS_NORM_ARGTYPES = [_ptr, _i64, _i64, _i64, _ptr, _float, _ptr, _i64]
_RMS_NORM_ROPE_ARGTYPES = [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _float, _ptr, _ptr, _i64, _ptr]
_GEMV_ARGTYPES = [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _int]
GEMV_MAX_INPUT_ROWS = 32  # as in csrc/gemv.c
GEMV_DECODE_ROWS = 16  # the rows `gemv_applies` admits unless told otherwise (see gemv_preferred_rows)
# int8 weights take the tile GEMM up to here, where it replaced the GEMV (built-in model's linears at
# 8, 16 and 32 rows: 0.77x, 0.70x and 0.63x the GEMV's time); more rows keep PyTorch's int8 GEMM.
GEMM_ROWS_INT8_MAX_ROWS = GEMV_MAX_INPUT_ROWS
_GEMM_FORMATS = {torch.float32: 0, torch.int8: 1}  # as in csrc/gemm_rows.c
_GEMM_FORMAT_BF16 = 2  # bfloat16: taken on AMX tiles only (csrc/gemm_amx.c)


def _env_flag(name: str) -> bool:
    """An on/off environment switch, on unless set to 0, false, no or off."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def native_kernels_enabled() -> bool:
    """Whether the C kernels may be used: not disabled by the environment and compiled (once per
    process; a failed build is logged once and the eager path is used)."""
    if not _env_flag(NATIVE_KERNELS_ENV):
        return False
    return _library() is not None


def amx_available() -> bool:
    """Whether bfloat16 linears of 6 to 32 float32 rows and int8 ones of 8 to 32 run on AMX tiles
    (csrc/gemm_amx.c): the kernels are built for a CPU with AMX, the OS permits the tiles, and they
    are switched on (`HYBRIDSERVE_AMX`, or `set_amx`)."""
    library = _library() if native_kernels_enabled() else None
    return library is not None and bool(library.gemm_amx_available())


def set_amx(enabled: bool) -> bool:
    """Switches the AMX GEMMs on or off for this process (the decode step, `gemv`, `gemm_rows`);
    returns whether they were on. Off, those rows take the GEMV or the float32 tile (for
    comparisons and tests)."""
    library = _library()
    return bool(library.gemm_amx_set_enabled(int(enabled))) if library is not None else False


def _cpu_signature() -> str:
    """What the compiled code depends on besides its source: CPU model and instruction set."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    except OSError:
        wanted = []
    return "|".join([platform.machine(), platform.processor(), *wanted])


def _compiler() -> str | None:
    name = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    executable = name.split()[0]
    return name if shutil.which(executable) else (shutil.which("gcc") or shutil.which("cc"))


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "hybridserve" / "kernels"


def _build(compiler: str, target: Path) -> None:
    """Compile SOURCES to `target` atomically (a concurrent build of the same key is harmless)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        subprocess.run([*compiler.split(), *CFLAGS, *map(str, SOURCES), "-o", str(partial), "-lm", "-lpthread"],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(partial, target)


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: the CPU decode runs on eager PyTorch ops (slower)")
        return None
    try:
        version = subprocess.run([*compiler.split(), "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
        sources = [source.read_text() for source in [*SOURCES, *HEADERS]]
        key = hashlib.sha256("\0".join([*sources, compiler, version, " ".join(CFLAGS),
                                        _cpu_signature()]).encode()).hexdigest()[:20]
        target = _cache_dir() / f"kernels-{key}.so"
        if not target.exists():
            _build(compiler, target)
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("building the C decode kernels failed; using eager PyTorch ops: %s", detail)
        return None
    library.gdn_decode_f32.argtypes = _GDN_DECODE_ARGTYPES
    library.gdn_decode_f32.restype = ctypes.c_int
    library.gdn_prefill_f32.argtypes = _GDN_PREFILL_ARGTYPES
    library.gdn_prefill_f32.restype = ctypes.c_int
    library.gemv_f32.argtypes = _GEMV_ARGTYPES
    library.gemv_f32.restype = ctypes.c_int
    library.gemv_i8.argtypes = [_ptr, *_GEMV_ARGTYPES]
    library.gemv_i8.restype = ctypes.c_int
    library.gemv_bf16.argtypes = _GEMV_ARGTYPES
    library.gemv_bf16.restype = ctypes.c_int
    library.gemm_amx.argtypes = [_ptr, _ptr, _int, *_GEMV_ARGTYPES[1:]]
    library.gemm_amx.restype = ctypes.c_int
    library.gemm_amx_available.argtypes = []
    library.gemm_amx_available.restype = ctypes.c_int
    library.gemm_amx_set_enabled.argtypes = [_int]
    library.gemm_amx_set_enabled.restype = ctypes.c_int
    library.gemm_amx_set_enabled(int(_env_flag(AMX_ENV)))
    library.gemv_preferred_rows.argtypes = []
    library.gemv_preferred_rows.restype = ctypes.c_int
    for kernel in (library.gemm_rows, library.gemm_rows_silu_mul):
        kernel.argtypes = [_ptr, _ptr, _int, *_GEMV_ARGTYPES[1:]]
        kernel.restype = ctypes.c_int
    library.gemm_rows_bounds.argtypes = [ctypes.POINTER(_int), ctypes.POINTER(_int)]
    library.gemm_rows_bounds.restype = None
    library.prefill_attention_f32.argtypes = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64, _float,
                                              _ptr, _int]
    library.prefill_attention_f32.restype = ctypes.c_int
    library.prefill_attention_max_tokens.argtypes = []
    library.prefill_attention_max_tokens.restype = ctypes.c_int
    library.logits_argmax_finite.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _ptr, _int]
    library.logits_argmax_finite.restype = None
    library.decode_step_workspace_floats.argtypes = [_ptr, _i64, _ptr, _i64, _int]
    library.decode_step_workspace_floats.restype = _i64
    library.decode_step_f32.argtypes = ([_ptr, _i64] + [_ptr] * 5 + [_i64] * 3 + [_ptr] * 3 + [_i64] + [_ptr] * 2
                                        + [_i64] + [_ptr] * 3 + [_int])
    library.decode_step_f32.restype = ctypes.c_int
    for name, argtypes in (("rms_norm_f32", _RMS_NORM_ARGTYPES),
                           ("rms_norm_rope_f32", _RMS_NORM_ROPE_ARGTYPES),
                           ("gated_rms_norm_f32", [_ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _float, _ptr]),
                           ("silu_mul_f32", [_ptr, _i64, _i64, _i64, _ptr])):
        getattr(library, name).argtypes = argtypes
        getattr(library, name).restype = None
    return library


def row_stride(x: torch.Tensor) -> int | None:
    """The distance between consecutive rows (last-dim vectors) of `x` when every row is contiguous
    and the rows are evenly spaced (e.g. q heads split off a fused projection); else None."""
    if x.dim() == 0 or (x.stride(-1) != 1 and x.shape[-1] > 1):
        return None
    if x.dim() == 1:
        return x.shape[0]
    stride = x.stride(-2)
    for dim in range(x.dim() - 3, -1, -1):  # leading dims must step over whole runs of rows
        if x.shape[dim] > 1 and x.stride(dim) != x.stride(dim + 1) * x.shape[dim + 1]:
            return None
    return stride


def rms_norm_applies(x: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether `rms_norm_f32` takes these inputs: evenly spaced float32 CPU rows of at most
    CHUNK_MAX_ELEMENTS elements (decode rows and short chunks: on a 64-token chunk torch's six ops
    each wait for a sleeping OpenMP worker)."""
    return scale.dtype == torch.float32 and chunk_rows_apply(x)


def rms_norm_f32(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * scale over the last dim of float32 CPU rows; returns a
    contiguous tensor of x's shape (check `rms_norm_applies` first)."""
    dim, stride = x.shape[-1], row_stride(x)
    if scale.shape != (dim,) or not scale.is_contiguous():
        raise ValueError(f"rms_norm_f32: scale must be a contiguous [{dim}] tensor, got {tuple(scale.shape)}")
    if stride is None:
        raise ValueError("rms_norm_f32: rows must be contiguous and evenly spaced")
    library = _library()
    assert library is not None, "check rms_norm_applies() first"
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.numel() // dim if dim else 0
    library.rms_norm_f32(x.data_ptr(), rows, dim, stride, scale.data_ptr(), eps, out.data_ptr(), dim)
    return out


def norm_rope_applies(x: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether `rms_norm_rope_f32` takes x [T, heads, dim]: float32 CPU with each head's dims
    contiguous (tokens and heads at any strides: a chunk's q or k heads inside the fused projection
    rows), at most CHUNK_MAX_ELEMENTS elements, and the kernels enabled."""
    return (x.dim() == 3 and x.is_cpu and x.dtype == torch.float32 and scale.dtype == torch.float32
            and 0 < x.numel() <= CHUNK_MAX_ELEMENTS and (x.stride(2) == 1 or x.shape[2] == 1)
            and native_kernels_enabled())


def rms_norm_rope_f32(x: torch.Tensor, scale: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
                      ) -> torch.Tensor:
    """RMSNorm of each head of x [T, heads, dim] (float32 CPU, each head contiguous) times `scale`,
    then rotary on the first `rot` dims with cos, sin [T, 1, rot] (rotate-half layout); returns a
    contiguous [T, heads, dim] (check `norm_rope_applies` first)."""
    tokens, heads, dim = x.shape
    rot = cos.shape[-1]
    if (x.stride(2) != 1 and dim > 1) or scale.shape != (dim,) or cos.shape != (tokens, 1, rot) \
            or sin.shape != cos.shape or rot > dim or rot % 2 \
            or not (cos.is_contiguous() and sin.is_contiguous() and scale.is_contiguous()) \
            or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError("rms_norm_rope_f32: shapes, layouts or dtypes do not match")
    library = _library()
    assert library is not None, "check norm_rope_applies() first"
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    library.rms_norm_rope_f32(x.data_ptr(), tokens, heads, dim, x.stride(0), x.stride(1), scale.data_ptr(), eps,
                              cos.data_ptr(), sin.data_ptr(), rot, out.data_ptr())
    return out


def chunk_rows_apply(*tensors: torch.Tensor) -> bool:
    """Whether the gate kernels (`gated_rms_norm_f32`, `silu_mul_f32`) take these float32 CPU
    tensors: evenly spaced contiguous rows, at most CHUNK_MAX_ELEMENTS elements each, kernels on."""
    return all(x.is_cpu and x.dtype == torch.float32 and x.dim() >= 1 and 0 < x.numel() <= CHUNK_MAX_ELEMENTS
               and row_stride(x) is not None for x in tensors) and native_kernels_enabled()


def gated_rms_norm_f32(x: torch.Tensor, gate: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """scale * rms_norm(x) * silu(gate) over the last dim (x and gate of one shape); returns a
    contiguous tensor of x's shape (check `chunk_rows_apply` first)."""
    dim = x.shape[-1]
    if gate.shape != x.shape or scale.shape != (dim,) or not scale.is_contiguous() or scale.dtype != torch.float32:
        raise ValueError("gated_rms_norm_f32: x, gate and scale shapes or dtypes do not match")
    library = _library()
    assert library is not None, "check chunk_rows_apply() first"
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    library.gated_rms_norm_f32(x.data_ptr(), gate.data_ptr(), x.numel() // dim, dim, row_stride(x),
                               row_stride(gate), scale.data_ptr(), eps, out.data_ptr())
    return out


def silu_mul_f32(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :half]) * x[..., half:] for a fused [gate | up] last dim; returns a contiguous
    [..., half] tensor (check `chunk_rows_apply` first)."""
    width = x.shape[-1]
    if width % 2:
        raise ValueError(f"silu_mul_f32: the last dim must be even, got {width}")
    library = _library()
    assert library is not None, "check chunk_rows_apply() first"
    out = torch.empty((*x.shape[:-1], width // 2), dtype=x.dtype, device=x.device)
    library.silu_mul_f32(x.data_ptr(), x.numel() // width, width // 2, row_stride(x), out.data_ptr())
    return out


def argmax_and_finite(logits: torch.Tensor) -> tuple[list[int], list[bool]] | None:
    """Each row's first maximum (as `argmax(dim=-1)`) and whether the row is all finite, in one C
    pass (csrc/logits.c); None unless `logits` is a float32 CPU [rows, vocab] tensor with
    contiguous rows and the kernels are enabled (the caller then asks torch)."""
    if (logits.dim() != 2 or logits.dtype != torch.float32 or not logits.is_cpu or logits.shape[1] == 0
            or logits.stride(1) != 1 or not native_kernels_enabled()):
        return None
    library = _library()
    assert library is not None
    rows = logits.shape[0]
    argmax = torch.empty(rows, dtype=torch.int64)
    finite = torch.empty(rows, dtype=torch.uint8)
    library.logits_argmax_finite(logits.data_ptr(), rows, logits.shape[1], logits.stride(0), argmax.data_ptr(),
                                 finite.data_ptr(), torch.get_num_threads())
    return argmax.tolist(), [bool(flag) for flag in finite.tolist()]


def gemv_preferred_rows() -> int:
    """The most rows for which the compiled GEMV beats PyTorch's GEMMs (csrc/gemv.c): 32 on AVX-512,
    16 elsewhere or without the kernels."""
    return _library_preferred_rows() if native_kernels_enabled() else GEMV_DECODE_ROWS


@lru_cache(maxsize=1)
def _library_preferred_rows() -> int:
    library = _library()
    return int(library.gemv_preferred_rows()) if library is not None else GEMV_DECODE_ROWS


def gemv_applies(weight: torch.Tensor, x: torch.Tensor, max_rows: int = GEMV_DECODE_ROWS) -> bool:
    """Whether `gemv` takes x @ weight.T: 1..max_rows (at most GEMV_MAX_INPUT_ROWS) float32 CPU rows
    with contiguous columns, a contiguous float32, bfloat16 or int8 weight, and the kernels enabled."""
    rows = min(max_rows, GEMV_MAX_INPUT_ROWS)
    return (x.dim() == 2 and 0 < x.shape[0] <= rows and x.dtype == torch.float32 and x.is_cpu
            and (x.stride(1) == 1 or x.shape[1] == 1)
            and weight.dtype in (torch.float32, torch.bfloat16, torch.int8)
            and weight.is_cpu and weight.is_contiguous() and native_kernels_enabled())


@lru_cache(maxsize=1)
def gemm_rows_bounds() -> tuple[int, int]:
    """The rows `gemm_rows` takes with this build of the kernels, (0, 0) for none (csrc/gemm_rows.c:
    6..128 where the compiler targets AVX-512)."""
    library = _library()
    if library is None:
        return 0, 0
    low, high = _int(), _int()
    library.gemm_rows_bounds(ctypes.byref(low), ctypes.byref(high))
    return low.value, high.value


def gemm_rows_applies(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether `gemm_rows` takes x @ weight.T: float32 CPU rows (contiguous, evenly spaced) in
    `gemm_rows_bounds` (int8 weights: up to GEMM_ROWS_INT8_MAX_ROWS of them), a contiguous float32
    or int8 CPU weight, and the kernels enabled."""
    if x.dim() != 2 or x.dtype != torch.float32 or weight.dtype not in _GEMM_FORMATS or not x.is_cpu:
        return False
    low, high = gemm_rows_bounds() if native_kernels_enabled() else (0, 0)
    if weight.dtype == torch.int8:
        high = min(high, GEMM_ROWS_INT8_MAX_ROWS)
    return (low <= x.shape[0] <= high and low > 0 and (x.stride(1) == 1 or x.shape[1] == 1)
            and weight.is_cpu and weight.is_contiguous())


def gemm_rows(weight: torch.Tensor, x: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T for 6..128 float32 CPU rows on the plain [out, in] weight: float32, or int8
    with float32 `scales` [out] (y = (x @ W.T) * scales) (csrc/gemm_rows.c; check
    `gemm_rows_applies` first). Returns a new contiguous [rows, out]."""
    out_features, in_features = weight.shape
    if x.shape[1] != in_features:
        raise ValueError(f"gemm_rows: x has {x.shape[1]} columns, the weight {in_features}")
    y = torch.empty(x.shape[0], out_features)
    _gemm_rows_call("gemm_rows", weight, scales, out_features, x, y)
    return y


def gemm_rows_silu_mul(weight: torch.Tensor, x: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x @ G.T) * (x @ U.T) for the fused [G; U] weight [2 * half, in] (the MLP's gate and up;
    float32, or int8 with `scales` [2 * half]) and 6..128 float32 CPU rows, the [rows, 2 * half]
    projection never stored (csrc/gemm_rows.c; check `gemm_rows_applies` first). Returns a new
    contiguous [rows, half]."""
    out_features, in_features = weight.shape
    if x.shape[1] != in_features or out_features % 2:
        raise ValueError(f"gemm_rows_silu_mul: x has {x.shape[1]} columns, the weight {tuple(weight.shape)} "
                         "(an even number of rows)")
    half = out_features // 2
    y = torch.empty(x.shape[0], half)
    _gemm_rows_call("gemm_rows_silu_mul", weight, scales, half, x, y)
    return y


def _gemm_rows_call(name: str, weight: torch.Tensor, scales: torch.Tensor | None, out_features: int,
                    x: torch.Tensor, y: torch.Tensor) -> None:
    if weight.dtype not in _GEMM_FORMATS:
        raise ValueError(f"{name}: weights must be float32 or int8, got {weight.dtype}")
    int8 = weight.dtype == torch.int8
    if int8 != (scales is not None) or (int8 and (scales.shape != (weight.shape[0],) or scales.dtype != torch.float32
                                                  or not scales.is_contiguous())):
        raise ValueError(f"{name}: int8 weights need contiguous float32 scales [{weight.shape[0]}], "
                         "float32 weights none")
    library = _library()
    assert library is not None, "check gemm_rows_applies() first"
    kernel = getattr(library, name)
    if kernel(weight.data_ptr(), scales.data_ptr() if scales is not None else None, _GEMM_FORMATS[weight.dtype],
              out_features, weight.shape[1], x.data_ptr(), x.shape[0], x.stride(0), y.data_ptr(), y.shape[1],
              torch.get_num_threads()):
        raise ValueError(f"gemm_rows takes {gemm_rows_bounds()} rows of float32 or int8 weights with this build, "
                         f"got {x.shape[0]} of {weight.dtype}")


@lru_cache(maxsize=1)
def prefill_attention_max_tokens() -> int:
    """The longest chunk `prefill_attention` takes with this build (csrc/prefill_attention.c: 128
    query tokens where the compiler targets AVX-512, else 0)."""
    library = _library()
    return int(library.prefill_attention_max_tokens()) if library is not None else 0


def prefill_attention_applies(q: torch.Tensor, cache_keys: torch.Tensor, slots: torch.Tensor) -> bool:
    """Whether `prefill_attention` takes this chunk: float32 CPU queries [T, heads, dim] with heads
    contiguous, T up to `prefill_attention_max_tokens`, dim a multiple of 64 up to 256; one layer of
    the paged keys contiguous; int64 slots; the kernels enabled."""
    if q.dim() != 3 or q.dtype != torch.float32 or not q.is_cpu or cache_keys.dtype != torch.float32:
        return False
    tokens, heads, dim = q.shape
    return (0 < tokens <= (prefill_attention_max_tokens() if native_kernels_enabled() else 0)
            and dim % 64 == 0 and dim <= 256 and q.stride(2) == 1 and q.stride(1) == dim
            and cache_keys.dim() == 3 and cache_keys.is_contiguous() and cache_keys.shape[2] == dim
            and heads % cache_keys.shape[1] == 0 and slots.dtype == torch.int64 and slots.is_contiguous()
            and slots.dim() == 1 and slots.shape[0] >= tokens)


def prefill_attention(q: torch.Tensor, cache_keys: torch.Tensor, cache_values: torch.Tensor, slots: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Causal attention of a chunk's T queries (the sequence's last T positions) over the keys and
    values at `slots` ([prefix + T] flat slots, in position order) of one layer of the paged cache
    ([num_slots, kv_heads, dim] each), read in place (csrc/prefill_attention.c; check
    `prefill_attention_applies` first). Returns a new contiguous [T, heads, dim]."""
    tokens, heads, dim = q.shape
    if cache_values.shape != cache_keys.shape or not cache_values.is_contiguous():
        raise ValueError("prefill_attention: keys and values must be contiguous and of one shape")
    lowest, highest = (int(bound) for bound in slots.aminmax())  # the kernel reads through them unchecked
    if lowest < 0 or highest >= cache_keys.shape[0]:
        raise IndexError(f"prefill_attention: slots [{lowest}, {highest}] outside the cache's {cache_keys.shape[0]}")
    library = _library()
    assert library is not None, "check prefill_attention_applies() first"
    out = torch.empty(tokens, heads, dim)
    status = library.prefill_attention_f32(q.data_ptr(), tokens, heads, dim, q.stride(0), cache_keys.data_ptr(),
                                           cache_values.data_ptr(), cache_keys.shape[1], slots.data_ptr(),
                                           slots.shape[0] - tokens, scale, out.data_ptr(), torch.get_num_threads())
    if status == 2:
        raise MemoryError("prefill_attention: out of memory for its scratch")
    if status:
        raise ValueError(f"prefill_attention: this build does not take q {tuple(q.shape)}")
    return out


def gemv(weight: torch.Tensor, x: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T for a few float32 CPU rows (csrc/gemv.c): weight [out, in] contiguous float32 or
    bfloat16 (widened exactly), or int8 with float32 `scales` [out] (y = (x @ W.T) * scales); x
    [rows, in] (check `gemv_applies` first). Returns a new contiguous float32 [rows, out]."""
    out_features, in_features = weight.shape
    rows = x.shape[0]
    if x.shape[1] != in_features:
        raise ValueError(f"gemv: x has {x.shape[1]} columns, the weight {in_features}")
    int8 = weight.dtype == torch.int8
    if int8 and (scales is None or scales.shape != (out_features,) or scales.dtype != torch.float32
                 or not scales.is_contiguous()):
        raise ValueError(f"gemv: int8 weights need contiguous float32 scales [{out_features}]")
    library = _library()
    assert library is not None, "check gemv_applies() first"
    y = torch.empty(rows, out_features)
    threads = torch.get_num_threads()
    if int8:
        assert scales is not None
        failed = library.gemv_i8(weight.data_ptr(), scales.data_ptr(), out_features, in_features, x.data_ptr(), rows,
                                 x.stride(0), y.data_ptr(), out_features, threads)
    elif weight.dtype == torch.bfloat16:  # AMX tiles where they take the rows (as the decode step)
        args = (weight.data_ptr(), out_features, in_features, x.data_ptr(), rows, x.stride(0), y.data_ptr(),
                out_features, threads)
        failed = library.gemm_amx(args[0], None, _GEMM_FORMAT_BF16, *args[1:]) \
            and library.gemv_bf16(*args)
    else:
        failed = library.gemv_f32(weight.data_ptr(), out_features, in_features, x.data_ptr(), rows, x.stride(0),
                                  y.data_ptr(), out_features, threads)
    if failed:
        raise ValueError(f"gemv takes 1..{GEMV_MAX_INPUT_ROWS} rows, got {rows}")
    return y


def gdn_decode_f32(proj: torch.Tensor, b_offset: int, a_offset: int, slots: torch.Tensor, conv_live: torch.Tensor,
                   rec_live: torch.Tensor, conv_weight: torch.Tensor, dt_bias: torch.Tensor,
                   neg_decay_rate: torch.Tensor, num_k_heads: int, l2_eps: float, in_place: bool = False,
                   norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One GDN decode step for a batch, fused (see csrc/gdn_decode.c).

    proj [B, P] float32 rows of the fused input projection whose first conv_dim columns are the
    conv inputs and whose columns `b_offset` and `a_offset` start the beta and decay gates (rows
    may be strided, columns contiguous); slots [B] int64 live-state slots; conv_live
    [S, conv_dim, K-1] and rec_live [S, Hv, Dk, Dv] float32 contiguous; conv_weight [conv_dim, K];
    dt_bias and neg_decay_rate [Hv] float32. Returns (core output [B, Hv, Dv], conv windows
    [B, conv_dim, K-1], recurrent states [B, Hv, Dk, Dv]): the new ones, live state only read; or
    with `in_place` the previous ones (the undo record), the live slots holding the new ones.
    With `norm_weight` [Dv] the output is the GDN output norm, w * rms_norm(core) * silu(z), z being
    the projection's columns after the conv inputs.
    """
    library = _library()
    assert library is not None, "check native_kernels_enabled() first"
    batch = proj.shape[0]
    _, num_v_heads, head_k, head_v = rec_live.shape
    conv_dim, kernel = conv_weight.shape
    floats = (proj, conv_live, rec_live, conv_weight, dt_bias, neg_decay_rate)
    if norm_weight is not None:
        floats += (norm_weight,)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in floats) or slots.dtype != torch.int64 \
            or slots.device.type != "cpu":
        raise ValueError("gdn_decode_f32 takes float32 CPU tensors and int64 slots")
    if proj.stride(1) != 1 or not all(t.is_contiguous() for t in floats[1:]) or not slots.is_contiguous():
        raise ValueError("gdn_decode_f32 needs contiguous state, weights, slots and projection columns")
    value_dim = num_v_heads * head_v
    if (kernel < 2 or conv_live.shape != (rec_live.shape[0], conv_dim, kernel - 1) or num_v_heads % num_k_heads
            or conv_dim != 2 * num_k_heads * head_k + value_dim or slots.shape != (batch,)
            or b_offset < conv_dim + value_dim or a_offset < b_offset + num_v_heads
            or proj.shape[1] < a_offset + num_v_heads or dt_bias.shape != (num_v_heads,)
            or neg_decay_rate.shape != (num_v_heads,)
            or (norm_weight is not None and norm_weight.shape != (head_v,))):
        raise ValueError("gdn_decode_f32: projection, state, slot and weight shapes disagree")
    core = torch.empty(batch, num_v_heads, head_v)
    scratch = torch.empty(batch, conv_dim)
    out_conv = torch.empty(batch, conv_dim, kernel - 1)
    out_rec = torch.empty(batch, num_v_heads, head_k, head_v)
    failed = library.gdn_decode_f32(
        batch, num_k_heads, num_v_heads, head_k, head_v, kernel, proj.data_ptr(), proj.stride(0), b_offset,
        a_offset, slots.data_ptr(), rec_live.shape[0], conv_live.data_ptr(), rec_live.data_ptr(),
        conv_weight.data_ptr(), dt_bias.data_ptr(), neg_decay_rate.data_ptr(), l2_eps,
        norm_weight.data_ptr() if norm_weight is not None else None, norm_eps, torch.get_num_threads(),
        int(in_place), scratch.data_ptr(), out_conv.data_ptr(), out_rec.data_ptr(), core.data_ptr())
    if failed:
        raise IndexError(f"gdn_decode_f32: a state slot is outside [0, {rec_live.shape[0]}) or repeated")
    return core, out_conv, out_rec


def gdn_prefill_f32(x: torch.Tensor, conv_state: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    rec_state: torch.Tensor, conv_weight: torch.Tensor, num_k_heads: int, l2_eps: float,
                    capture_tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One sequence's prefill chunk through a GDN layer, token by token (see csrc/gdn_prefill.c).

    x [T, conv_dim] float32: the chunk's conv inputs (rows may be strided, columns contiguous, as
    the in_proj output's first columns); conv_state [conv_dim, K-1] the inputs before the chunk;
    g, beta [T, Hv] float32 log-decay and beta; rec_state [Hv, Dk, Dv] the state before the chunk;
    conv_weight [conv_dim, K]. Live state is only read. Returns (core output [T, Hv, Dv], final
    state, the states after each of `capture_tokens` tokens, in the order given).
    """
    library = _library()
    assert library is not None, "check native_kernels_enabled() first"
    num_v_heads, head_k, head_v = rec_state.shape
    conv_dim, kernel = conv_weight.shape
    tokens = x.shape[0]
    floats = (x, conv_state, g, beta, rec_state, conv_weight)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in floats):
        raise ValueError("gdn_prefill_f32 takes float32 CPU tensors")
    if x.dim() != 2 or x.stride(1) != 1 or not all(t.is_contiguous() for t in floats[1:]):
        raise ValueError("gdn_prefill_f32 needs contiguous state, gates and weights and contiguous input columns")
    if (kernel < 1 or num_v_heads % num_k_heads or conv_dim != 2 * num_k_heads * head_k + num_v_heads * head_v
            or x.shape[1] != conv_dim or conv_state.shape != (conv_dim, kernel - 1)
            or g.shape != (tokens, num_v_heads) or beta.shape != g.shape):
        raise ValueError("gdn_prefill_f32: input, gate, state and weight shapes disagree")
    if any(not 1 <= t <= tokens for t in capture_tokens):
        raise ValueError(f"gdn_prefill_f32: capture points {capture_tokens} must lie within 1..{tokens}")
    captures = torch.tensor(capture_tokens, dtype=torch.int64)
    captured = torch.empty(len(capture_tokens), num_v_heads, head_k, head_v)
    final_state = torch.empty(num_v_heads, head_k, head_v)
    core = torch.empty(tokens, num_v_heads, head_v)
    scratch = torch.empty((2 * kernel - 1 + tokens) * conv_dim)
    failed = library.gdn_prefill_f32(
        tokens, num_k_heads, num_v_heads, head_k, head_v, kernel, x.data_ptr(), x.stride(0), conv_state.data_ptr(),
        conv_weight.data_ptr(), g.data_ptr(), beta.data_ptr(), rec_state.data_ptr(), l2_eps, len(capture_tokens),
        captures.data_ptr(), torch.get_num_threads(), scratch.data_ptr(), captured.data_ptr(),
        final_state.data_ptr(), core.data_ptr())
    if failed:
        raise ValueError("gdn_prefill_f32: capture points out of range")
    return core, final_state, list(captured.unbind(0))

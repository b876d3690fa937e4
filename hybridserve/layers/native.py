"""Fused CPU kernels in C (csrc/), compiled on first use into the user's cache directory and called
through ctypes with the signatures kernel_abi.py reads from csrc/hybridserve_kernels.h.

Each wrapper checks its tensors' dtype (TypeError), device, layout and shape (ValueError) before any
pointer reaches C. Without the kernels (no compiler, an interface mismatch, another device or dtype,
`HYBRIDSERVE_NATIVE_KERNELS=0`) callers use the eager PyTorch ops. docs/cpu-kernels.md says which
kernel runs where and how the build is keyed and flagged.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import sysconfig
import tempfile
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import torch

from hybridserve import envs
from hybridserve.layers.kernel_abi import WEIGHT_FORMATS, KernelAbiError, KernelLibrary

logger = logging.getLogger(__name__)

NATIVE_KERNELS_ENV = envs.NATIVE_KERNELS.name
SOURCES = sorted((Path(__file__).with_name("csrc")).glob("*.c"))
HEADERS = sorted((Path(__file__).with_name("csrc")).glob("*.h"))
# elements the single-threaded elementwise kernels (norms, gates) take: decode rows and short chunks
CHUNK_MAX_ELEMENTS = 1 << 18
OPTIMIZE_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
# -Wno-psabi: static helpers returning AVX vectors never cross that ABI boundary
WARNING_FLAGS = ["-Wall", "-Wextra", "-Wshadow", "-Wstrict-prototypes", "-Wmissing-prototypes", "-Wno-psabi",
                 "-Werror"]
CFLAGS = OPTIMIZE_FLAGS + WARNING_FLAGS

GEMV_MAX_INPUT_ROWS = 32  # as in csrc/gemv.c
GEMV_DECODE_ROWS = 16  # the rows `gemv_applies` admits unless told otherwise (see gemv_preferred_rows)
GEMM_ROWS_INT8_MAX_ROWS = GEMV_MAX_INPUT_ROWS  # beyond, int8 weights keep PyTorch's int8 GEMM
_GEMM_DTYPES = (torch.float32, torch.int8)  # gemm_rows' weights (bfloat16 ones: AMX tiles only, via gemv)
_GEMV_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
_FLOAT32 = (torch.float32,)
_INT64 = (torch.int64,)
_Dims = int | tuple[int, ...] | None  # a tensor's number of dimensions, or its exact shape


def prepare_kernels() -> bool:
    """Build (first time only) and load the CPU kernels now, so that start-up pays for the compile
    and the first request does not; False where they are switched off or cannot be built."""
    return native_kernels_enabled()


def native_kernels_enabled() -> bool:
    """Whether the C kernels may be used: not disabled by the environment, and compiled (a failed
    build or an interface mismatch is logged once per process)."""
    return envs.native_kernels() and _library() is not None


def amx_available() -> bool:
    """Whether bf16 and int8 linears of a few to 32 rows run on AMX tiles (csrc/gemm_amx.c): built
    for a CPU with AMX, permitted by the OS, and switched on (`HYBRIDSERVE_AMX`, or `set_amx`)."""
    library = _library() if native_kernels_enabled() else None
    return library is not None and bool(library.gemm_amx_available())


def set_amx(enabled: bool) -> bool:
    """Switch the AMX GEMMs on or off for this process; returns whether they were on."""
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


def _untrusted_reason(path: Path) -> str | None:
    """Why `path` (a directory we load code from, or the library itself) could hold code another user
    placed there: not ours (nor root's), a symbolic link, or writable by its group or others; None
    when it is safe."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        return f"{str(path)!r} is a symbolic link"
    if info.st_uid not in (os.geteuid(), 0):
        return f"{str(path)!r} is owned by another user (uid {info.st_uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{str(path)!r} is writable by its group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _private_kernel_dir() -> Path:
    """The directory the kernels are built into and loaded from: the cache directory, created 0700,
    when it and its parent (`hybridserve/`) are ours and not group- or world-writable; otherwise a
    fresh private directory for this process (removed at exit), with one warning naming the cache
    directory and the fix."""
    cache = _cache_dir()
    try:
        cache.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        cache.mkdir(mode=0o700, exist_ok=True)
        reason = _untrusted_reason(cache.parent) or _untrusted_reason(cache)
    except OSError as exc:
        reason = f"{str(cache)!r} cannot be created ({exc.strerror or exc})"
    if reason is None:
        return cache
    fresh = Path(tempfile.mkdtemp(prefix="hybridserve-kernels-"))  # 0700, ours
    atexit.register(shutil.rmtree, fresh, ignore_errors=True)
    logger.warning("not loading C kernels from the cache: %s; building into %s for this process instead "
                   "(fix: chown -R $USER and chmod 700 %s, or remove it)", reason, fresh, cache.parent)
    return fresh


def _build(compiler: str, target: Path) -> None:
    """Compile SOURCES to `target` atomically (a concurrent build of the same key is harmless)."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        subprocess.run([*compiler.split(), *CFLAGS, *map(str, SOURCES), "-o", str(partial), "-lm", "-lpthread"],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(partial, target)


def _compiled_library() -> Path | None:
    """The kernels library for these sources, flags, compiler and CPU, built if not cached; None
    (logged) without a compiler or when the build fails."""
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: the CPU decode runs on eager PyTorch ops (slower)")
        return None
    try:
        version = subprocess.run([*compiler.split(), "--version"], check=False, capture_output=True, text=True,
                                 timeout=30).stdout
        sources = [source.read_text() for source in [*SOURCES, *HEADERS]]
        key = hashlib.sha256("\0".join([*sources, compiler, version, " ".join(CFLAGS),
                                        _cpu_signature()]).encode()).hexdigest()[:20]
        target = _private_kernel_dir() / f"kernels-{key}.so"
        if not target.exists() or _untrusted_reason(target) is not None:
            _build(compiler, target)  # replaces a library someone else could have written
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("building the C decode kernels failed; using eager PyTorch ops: %s", detail)
        return None
    return target


@lru_cache(maxsize=1)
def _library() -> KernelLibrary | None:
    """The loaded kernels library with the header's functions bound (once per process), or None."""
    target = _compiled_library()
    if target is None:
        return None
    try:
        library = KernelLibrary(target)
    except OSError as exc:
        logger.warning("loading the C decode kernels failed; using eager PyTorch ops: %s", exc)
        return None
    except KernelAbiError as exc:
        logger.error("the C kernels do not match their interface; using eager PyTorch ops: %s", exc)
        return None
    library.gemm_amx_set_enabled(int(envs.amx()))
    return library


def _call(kernel: str, *args: object, function: str | None = None) -> int:
    """Call the C function `function` (default: `kernel`), tensors passed as their data pointers;
    RuntimeError naming the wrapper when the kernels are unavailable."""
    library = _library()
    if library is None:
        raise RuntimeError(f"{kernel}: the C kernels are unavailable (ask its *_applies check first)")
    pointers = [arg.data_ptr() if isinstance(arg, torch.Tensor) else arg for arg in args]
    return int(getattr(library, function or kernel)(*pointers) or 0)


def _check_tensor(kernel: str, name: str, tensor: object, dtypes: Sequence[torch.dtype], dims: _Dims = None,
                  contiguous: bool = False, columns: bool = False) -> torch.Tensor:
    """`tensor` if it is a CPU tensor of one of `dtypes` with `dims` dimensions (or exactly that
    shape), contiguous, or with `columns` each row contiguous, when asked; else TypeError (not a
    tensor, another dtype) or ValueError naming the kernel and the argument."""
    shape = dims if isinstance(dims, tuple) else None
    rank = len(shape) if shape is not None else dims
    if (isinstance(tensor, torch.Tensor) and tensor.dtype in dtypes and tensor.is_cpu
            and (rank is None or tensor.dim() == rank) and (not contiguous or tensor.is_contiguous())
            and (not columns or tensor.stride()[-1] == 1) and (shape is None or tensor.shape == shape)):
        return tensor  # the common case in one test; the checks below only say what is wrong
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{kernel}: {name} must be a tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        wanted = " or ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
        raise TypeError(f"{kernel}: {name} must be {wanted}, got {str(tensor.dtype).removeprefix('torch.')}")
    if not tensor.is_cpu:
        raise ValueError(f"{kernel}: {name} must be on the CPU, got {tensor.device}")
    if rank is not None and tensor.dim() != rank:
        raise ValueError(f"{kernel}: {name} must have {rank} dimensions, got shape {tuple(tensor.shape)}")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{kernel}: {name} must be contiguous")
    if columns and tensor.stride()[-1] != 1 and tensor.shape[-1] > 1:
        raise ValueError(f"{kernel}: {name} must have contiguous rows (last-dimension stride 1)")
    if shape is not None and tensor.shape != shape:
        raise ValueError(f"{kernel}: {name} must have shape {shape}, got {tuple(tensor.shape)}")
    return tensor


def _check_contiguous(kernel: str, dtypes: Sequence[torch.dtype], **tensors: tuple[object, _Dims]) -> None:
    """Each of `tensors`, given as (tensor, dims), a contiguous CPU tensor of `dtypes` (see `_check_tensor`)."""
    for name, (tensor, dims) in tensors.items():
        _check_tensor(kernel, name, tensor, dtypes, dims, contiguous=True)


def check_index_tensors(kernel: str, **tensors: torch.Tensor) -> None:
    """Each of `tensors` a contiguous int64 CPU tensor (the ids, positions, slots and tables a C
    step reads as int64 arrays; the step checks their values itself)."""
    _check_contiguous(kernel, _INT64, **{name: (tensor, None) for name, tensor in tensors.items()})


def _check_rows(kernel: str, name: str, tensor: torch.Tensor) -> int:
    """The row stride of `tensor` (see `row_stride`), or ValueError when its rows are not evenly spaced."""
    stride = row_stride(tensor)
    if stride is None:
        raise ValueError(f"{kernel}: {name} must have contiguous, evenly spaced rows")
    return stride


def _float32_rows(x: torch.Tensor) -> bool:
    """x a float32 CPU [rows, columns] with contiguous columns."""
    return x.dim() == 2 and x.dtype == torch.float32 and x.is_cpu and (x.stride(1) == 1 or x.shape[1] == 1)


def _plain_weight(weight: torch.Tensor, dtypes: Sequence[torch.dtype]) -> bool:
    """weight a contiguous [out, in] CPU matrix of `dtypes`."""
    return weight.dtype in dtypes and weight.dim() == 2 and weight.is_cpu and weight.is_contiguous()


def _check_linear(kernel: str, weight: object, x: object, dtypes: Sequence[torch.dtype],
                  scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous [out, in] weight of `dtypes` (int8 with float32 scales [out], others with none)
    and float32 rows x [rows, in] with contiguous columns."""
    if (isinstance(weight, torch.Tensor) and isinstance(x, torch.Tensor) and scales is None
            and weight.dtype != torch.int8 and _plain_weight(weight, dtypes) and _float32_rows(x)
            and x.shape[1] == weight.shape[1]):
        return weight, x  # float weights in one test (a linear per call on the decode path)
    weight = _check_tensor(kernel, "weight", weight, dtypes, dims=2, contiguous=True)
    x = _check_tensor(kernel, "x", x, _FLOAT32, dims=2, columns=True)
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"{kernel}: x has {x.shape[1]} columns, the weight {weight.shape[1]}")
    if weight.dtype != torch.int8:
        if scales is not None:
            raise ValueError(f"{kernel}: scales go with int8 weights only, the weight is {weight.dtype}")
    elif scales is None:
        raise ValueError(f"{kernel}: int8 weights need contiguous float32 scales [{weight.shape[0]}]")
    else:
        _check_tensor(kernel, "scales", scales, _FLOAT32, (weight.shape[0],), contiguous=True)
    return weight, x


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


def chunk_rows_apply(*tensors: torch.Tensor) -> bool:
    """Whether the row kernels (`rms_norm_f32`, `gated_rms_norm_f32`, `silu_mul_f32`) take these
    float32 CPU tensors: evenly spaced contiguous rows, at most CHUNK_MAX_ELEMENTS elements each."""
    return all(x.is_cpu and x.dtype == torch.float32 and x.dim() >= 1 and 0 < x.numel() <= CHUNK_MAX_ELEMENTS
               and row_stride(x) is not None for x in tensors) and native_kernels_enabled()


def rms_norm_applies(x: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether `rms_norm_f32` takes these inputs (see `chunk_rows_apply`)."""
    return scale.dtype == torch.float32 and chunk_rows_apply(x)


def rms_norm_f32(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * scale over the last dim of float32 CPU rows; returns a
    contiguous tensor of x's shape."""
    kernel = "rms_norm_f32"
    _check_tensor(kernel, "x", x, _FLOAT32)
    dim = x.shape[-1] if x.dim() else 0
    stride = _check_rows(kernel, "x", x)
    _check_tensor(kernel, "scale", scale, _FLOAT32, (dim,), contiguous=True)
    out = torch.empty(x.shape, dtype=torch.float32, device="cpu")
    _call(kernel, x, x.numel() // dim if dim else 0, dim, stride, scale, eps, out, dim)
    return out


def norm_rope_applies(x: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether `rms_norm_rope_f32` takes x [T, heads, dim]: float32 CPU with each head's dims
    contiguous (tokens and heads at any strides), at most CHUNK_MAX_ELEMENTS elements."""
    return (x.dim() == 3 and x.is_cpu and x.dtype == torch.float32 and scale.dtype == torch.float32
            and 0 < x.numel() <= CHUNK_MAX_ELEMENTS and (x.stride(2) == 1 or x.shape[2] == 1)
            and native_kernels_enabled())


def rms_norm_rope_f32(x: torch.Tensor, scale: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
                      ) -> torch.Tensor:
    """RMSNorm of each head of x [T, heads, dim] times `scale`, then rotary on the first `rot` dims
    with cos, sin [T, 1, rot] (rotate-half layout); returns a contiguous [T, heads, dim]."""
    kernel = "rms_norm_rope_f32"
    tokens, heads, dim = _check_tensor(kernel, "x", x, _FLOAT32, dims=3, columns=True).shape
    rot = _check_tensor(kernel, "cos", cos, _FLOAT32, dims=3, contiguous=True).shape[-1]
    _check_contiguous(kernel, _FLOAT32, scale=(scale, (dim,)), cos=(cos, (tokens, 1, rot)), sin=(sin, (tokens, 1, rot)))
    if rot > dim or rot % 2:
        raise ValueError(f"{kernel}: the rotary width {rot} must be even and at most the head size {dim}")
    out = torch.empty(x.shape, dtype=torch.float32, device="cpu")
    _call(kernel, x, tokens, heads, dim, x.stride(0), x.stride(1), scale, eps, cos, sin, rot, out)
    return out


def gated_rms_norm_f32(x: torch.Tensor, gate: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """scale * rms_norm(x) * silu(gate) over the last dim (x and gate of one shape); returns a
    contiguous tensor of x's shape."""
    kernel = "gated_rms_norm_f32"
    _check_tensor(kernel, "x", x, _FLOAT32)
    _check_tensor(kernel, "gate", gate, _FLOAT32)
    if gate.shape != x.shape or x.dim() == 0:
        raise ValueError(f"{kernel}: x and gate must have one shape, got {tuple(x.shape)} and {tuple(gate.shape)}")
    ld_x, ld_gate = _check_rows(kernel, "x", x), _check_rows(kernel, "gate", gate)
    dim = x.shape[-1]
    _check_tensor(kernel, "scale", scale, _FLOAT32, (dim,), contiguous=True)
    out = torch.empty(x.shape, dtype=torch.float32, device="cpu")
    _call(kernel, x, gate, x.numel() // dim if dim else 0, dim, ld_x, ld_gate, scale, eps, out)
    return out


def silu_mul_f32(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :half]) * x[..., half:] for a fused [gate | up] last dim; returns a contiguous
    [..., half] tensor."""
    kernel = "silu_mul_f32"
    _check_tensor(kernel, "x", x, _FLOAT32)
    width = x.shape[-1] if x.dim() else 0
    if width == 0 or width % 2:
        raise ValueError(f"{kernel}: the last dim must be even and non-zero, got shape {tuple(x.shape)}")
    stride = _check_rows(kernel, "x", x)
    out = torch.empty((*x.shape[:-1], width // 2), dtype=torch.float32, device="cpu")
    _call(kernel, x, x.numel() // width, width // 2, stride, out)
    return out


def argmax_and_finite(logits: torch.Tensor) -> tuple[list[int], list[bool]] | None:
    """Each row's first maximum (as `argmax(dim=-1)`) and whether the row is all finite, in one C
    pass (csrc/logits.c); None unless `logits` is a float32 CPU [rows, vocab] tensor with
    contiguous rows and the kernels are enabled (the caller then asks torch)."""
    if not _float32_rows(logits) or logits.shape[1] == 0 or not native_kernels_enabled():
        return None
    rows = logits.shape[0]
    argmax = torch.empty(rows, dtype=torch.int64)
    finite = torch.empty(rows, dtype=torch.uint8)
    _call("logits_argmax_finite", logits, rows, logits.shape[1], logits.stride(0), argmax, finite,
          torch.get_num_threads())
    return argmax.tolist(), [bool(flag) for flag in finite.tolist()]


def gemv_preferred_rows() -> int:
    """The most rows for which the compiled GEMV beats PyTorch's GEMMs (csrc/gemv.c), or
    GEMV_DECODE_ROWS without the kernels."""
    return _library_preferred_rows() if native_kernels_enabled() else GEMV_DECODE_ROWS


@lru_cache(maxsize=1)
def _library_preferred_rows() -> int:
    library = _library()
    return int(library.gemv_preferred_rows()) if library is not None else GEMV_DECODE_ROWS


def gemv_applies(weight: torch.Tensor, x: torch.Tensor, max_rows: int = GEMV_DECODE_ROWS) -> bool:
    """Whether `gemv` takes x @ weight.T: 1..max_rows (at most GEMV_MAX_INPUT_ROWS) float32 CPU rows
    with contiguous columns, a contiguous float32, bfloat16 or int8 weight, and the kernels enabled."""
    return (_float32_rows(x) and 0 < x.shape[0] <= min(max_rows, GEMV_MAX_INPUT_ROWS)
            and _plain_weight(weight, _GEMV_DTYPES) and native_kernels_enabled())


def gemv(weight: torch.Tensor, x: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T for a few float32 CPU rows x [rows, in] (csrc/gemv.c): weight [out, in]
    contiguous float32, bfloat16 (widened exactly), or int8 with float32 `scales` [out]
    (y = (x @ W.T) * scales). Returns a new contiguous float32 [rows, out]."""
    weight, x = _check_linear("gemv", weight, x, _GEMV_DTYPES, scales)
    out_features, in_features = weight.shape
    rows = x.shape[0]
    y = torch.empty(rows, out_features)
    shape = (out_features, in_features, x, rows, x.stride(0), y, out_features, torch.get_num_threads())
    if scales is not None:  # int8 (checked above)
        failed = _call("gemv", weight, scales, *shape, function="gemv_i8")
    elif weight.dtype == torch.bfloat16:  # AMX tiles where they take the rows (as the decode step)
        failed = (_call("gemv", weight, None, WEIGHT_FORMATS[torch.bfloat16], *shape, function="gemm_amx")
                  and _call("gemv", weight, *shape, function="gemv_bf16"))
    else:
        failed = _call("gemv", weight, *shape, function="gemv_f32")
    if failed:
        raise ValueError(f"gemv takes 1..{GEMV_MAX_INPUT_ROWS} rows, got {rows}")
    return y


@lru_cache(maxsize=1)
def gemm_rows_bounds() -> tuple[int, int]:
    """The rows `gemm_rows` takes with this build of the kernels, (0, 0) for none (csrc/gemm_rows.c)."""
    library = _library()
    if library is None:
        return 0, 0
    low, high = ctypes.c_int(), ctypes.c_int()
    library.gemm_rows_bounds(ctypes.byref(low), ctypes.byref(high))
    return low.value, high.value


def gemm_rows_applies(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether `gemm_rows` takes x @ weight.T: float32 CPU rows with contiguous columns in
    `gemm_rows_bounds` (int8 weights: up to GEMM_ROWS_INT8_MAX_ROWS of them), a contiguous float32
    or int8 CPU weight, and the kernels enabled."""
    if not _float32_rows(x) or not _plain_weight(weight, _GEMM_DTYPES):
        return False
    low, high = gemm_rows_bounds() if native_kernels_enabled() else (0, 0)
    if weight.dtype == torch.int8:
        high = min(high, GEMM_ROWS_INT8_MAX_ROWS)
    return 0 < low <= x.shape[0] <= high


def gemm_rows(weight: torch.Tensor, x: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T for float32 CPU rows in `gemm_rows_bounds` on the [out, in] weight: float32, or
    int8 with float32 `scales` [out] (csrc/gemm_rows.c). Returns a new contiguous [rows, out]."""
    weight, x = _check_linear("gemm_rows", weight, x, _GEMM_DTYPES, scales)
    return _gemm_rows_call("gemm_rows", weight, scales, weight.shape[0], x)


def gemm_rows_silu_mul(weight: torch.Tensor, x: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x @ G.T) * (x @ U.T) for the fused [G; U] weight [2 * half, in] (the MLP's gate and up,
    as `gemm_rows` takes them), the projection never stored. Returns a new contiguous [rows, half]."""
    kernel = "gemm_rows_silu_mul"
    weight, x = _check_linear(kernel, weight, x, _GEMM_DTYPES, scales)
    if weight.shape[0] % 2:
        raise ValueError(f"{kernel}: the fused [gate; up] weight needs an even number of rows, got "
                         f"{tuple(weight.shape)}")
    return _gemm_rows_call(kernel, weight, scales, weight.shape[0] // 2, x)


def _gemm_rows_call(kernel: str, weight: torch.Tensor, scales: torch.Tensor | None, out_features: int,
                    x: torch.Tensor) -> torch.Tensor:
    """The checked GEMM `kernel` into a new y; ValueError when this build does not take the rows."""
    y = torch.empty(x.shape[0], out_features)
    if _call(kernel, weight, scales, WEIGHT_FORMATS[weight.dtype], out_features, weight.shape[1], x, x.shape[0],
             x.stride(0), y, out_features, torch.get_num_threads()):
        raise ValueError(f"{kernel} takes {gemm_rows_bounds()} rows of float32 or int8 weights with this build, "
                         f"got {x.shape[0]} of {weight.dtype}")
    return y


@lru_cache(maxsize=1)
def prefill_attention_max_tokens() -> int:
    """The longest chunk `prefill_attention` takes with this build (csrc/prefill_attention.c), 0 for none."""
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
    ([num_slots, kv_heads, dim] each), read in place. Returns a new contiguous [T, heads, dim]."""
    kernel = "prefill_attention"
    tokens, heads, dim = _check_tensor(kernel, "q", q, _FLOAT32, dims=3).shape
    if (q.stride(2) != 1 and dim > 1) or (q.stride(1) != dim and heads > 1):
        raise ValueError(f"{kernel}: each token's heads of q must be contiguous, got strides {q.stride()}")
    _check_contiguous(kernel, _FLOAT32, cache_keys=(cache_keys, 3), cache_values=(cache_values, 3))
    if cache_values.shape != cache_keys.shape or cache_keys.shape[2] != dim or heads % cache_keys.shape[1]:
        raise ValueError(f"{kernel}: keys {tuple(cache_keys.shape)} and values {tuple(cache_values.shape)} must be "
                         f"[slots, kv_heads, {dim}] with kv_heads dividing {heads}")
    _check_tensor(kernel, "slots", slots, _INT64, dims=1, contiguous=True)
    if slots.shape[0] < tokens:
        raise ValueError(f"{kernel}: {slots.shape[0]} slots for {tokens} query tokens")
    lowest, highest = (int(bound) for bound in slots.aminmax())  # the kernel reads through them unchecked
    if lowest < 0 or highest >= cache_keys.shape[0]:
        raise IndexError(f"{kernel}: slots [{lowest}, {highest}] outside the cache's {cache_keys.shape[0]}")
    out = torch.empty(tokens, heads, dim)
    status = _call(kernel, q, tokens, heads, dim, q.stride(0), cache_keys, cache_values, cache_keys.shape[1], slots,
                   slots.shape[0] - tokens, scale, out, torch.get_num_threads(), function="prefill_attention_f32")
    if status == 2:
        raise MemoryError(f"{kernel}: out of memory for its scratch")
    if status:
        raise ValueError(f"{kernel}: this build does not take q {tuple(q.shape)}")
    return out


def gdn_decode_f32(proj: torch.Tensor, b_offset: int, a_offset: int, slots: torch.Tensor, conv_live: torch.Tensor,
                   rec_live: torch.Tensor, conv_weight: torch.Tensor, dt_bias: torch.Tensor,
                   neg_decay_rate: torch.Tensor, num_k_heads: int, l2_eps: float, in_place: bool = False,
                   norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One GDN decode step for a batch, fused (csrc/gdn_decode.c).

    proj [B, P] float32 rows of the fused input projection (conv inputs in the first conv_dim
    columns, then z; the beta and decay gates from columns `b_offset` and `a_offset`; columns
    contiguous); slots [B] int64 live-state slots; conv_live [S, conv_dim, K-1] and rec_live
    [S, Hv, Dk, Dv] contiguous; conv_weight [conv_dim, K]; dt_bias, neg_decay_rate [Hv]. Returns
    (core output [B, Hv, Dv], conv windows, recurrent states): the new states, live state only
    read, or with `in_place` the replaced ones (the undo record), the live slots updated. With
    `norm_weight` [Dv] the output is the GDN output norm w * rms_norm(core) * silu(z).
    """
    kernel = "gdn_decode_f32"
    _check_tensor(kernel, "proj", proj, _FLOAT32, dims=2, columns=True)
    _check_tensor(kernel, "slots", slots, _INT64, dims=1, contiguous=True)
    _check_contiguous(kernel, _FLOAT32, conv_live=(conv_live, 3), rec_live=(rec_live, 4),
                      conv_weight=(conv_weight, 2), dt_bias=(dt_bias, 1), neg_decay_rate=(neg_decay_rate, 1))
    if norm_weight is not None:
        _check_tensor(kernel, "norm_weight", norm_weight, _FLOAT32, dims=1, contiguous=True)
    batch = proj.shape[0]
    num_slots, num_v_heads, head_k, head_v = rec_live.shape
    conv_dim, width = conv_weight.shape
    value_dim = num_v_heads * head_v
    if (width < 2 or num_k_heads < 1 or conv_live.shape != (num_slots, conv_dim, width - 1)
            or num_v_heads % num_k_heads or conv_dim != 2 * num_k_heads * head_k + value_dim or slots.shape != (batch,)
            or b_offset < conv_dim + value_dim or a_offset < b_offset + num_v_heads
            or proj.shape[1] < a_offset + num_v_heads or dt_bias.shape != (num_v_heads,)
            or neg_decay_rate.shape != (num_v_heads,)
            or (norm_weight is not None and norm_weight.shape != (head_v,))):
        raise ValueError(f"{kernel}: projection {tuple(proj.shape)} (gates at {b_offset}, {a_offset}), slots "
                         f"{tuple(slots.shape)}, conv state {tuple(conv_live.shape)}, recurrent state "
                         f"{tuple(rec_live.shape)}, conv weight {tuple(conv_weight.shape)} and {num_k_heads} key heads "
                         "disagree")
    core = torch.empty(batch, num_v_heads, head_v)
    out_conv = torch.empty(batch, conv_dim, width - 1)
    out_rec = torch.empty(batch, num_v_heads, head_k, head_v)
    if _call(kernel, batch, num_k_heads, num_v_heads, head_k, head_v, width, proj, proj.stride(0), b_offset,
             a_offset, slots, num_slots, conv_live, rec_live, conv_weight, dt_bias, neg_decay_rate, l2_eps,
             norm_weight, norm_eps, torch.get_num_threads(), int(in_place), torch.empty(batch, conv_dim), out_conv,
             out_rec, core):
        raise IndexError(f"{kernel}: a state slot is outside [0, {num_slots}) or repeated")
    return core, out_conv, out_rec


def gdn_prefill_f32(x: torch.Tensor, conv_state: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    rec_state: torch.Tensor, conv_weight: torch.Tensor, num_k_heads: int, l2_eps: float,
                    capture_tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One sequence's prefill chunk through a GDN layer, token by token (csrc/gdn_prefill.c).

    x [T, conv_dim] float32 conv inputs (columns contiguous); conv_state [conv_dim, K-1] the inputs
    before the chunk; g, beta [T, Hv] log-decay and beta; rec_state [Hv, Dk, Dv] the state before
    the chunk; conv_weight [conv_dim, K]. Live state is only read. Returns (core output
    [T, Hv, Dv], final state, the states after each of `capture_tokens` tokens, in that order).
    """
    kernel = "gdn_prefill_f32"
    _check_tensor(kernel, "x", x, _FLOAT32, dims=2, columns=True)
    _check_contiguous(kernel, _FLOAT32, conv_state=(conv_state, 2), g=(g, 2), beta=(beta, 2),
                      rec_state=(rec_state, 3), conv_weight=(conv_weight, 2))
    num_v_heads, head_k, head_v = rec_state.shape
    conv_dim, width = conv_weight.shape
    tokens = x.shape[0]
    if (width < 1 or num_k_heads < 1 or num_v_heads % num_k_heads
            or conv_dim != 2 * num_k_heads * head_k + num_v_heads * head_v
            or x.shape[1] != conv_dim or conv_state.shape != (conv_dim, width - 1)
            or g.shape != (tokens, num_v_heads) or beta.shape != g.shape):
        raise ValueError(f"{kernel}: input {tuple(x.shape)}, gates {tuple(g.shape)} and {tuple(beta.shape)}, "
                         f"states {tuple(conv_state.shape)} and {tuple(rec_state.shape)}, conv weight "
                         f"{tuple(conv_weight.shape)} and {num_k_heads} key heads disagree")
    if any(not 1 <= t <= tokens for t in capture_tokens):
        raise ValueError(f"{kernel}: capture points {capture_tokens} must lie within 1..{tokens}")
    captured = torch.empty(len(capture_tokens), num_v_heads, head_k, head_v)
    final_state = torch.empty(num_v_heads, head_k, head_v)
    core = torch.empty(tokens, num_v_heads, head_v)
    if _call(kernel, tokens, num_k_heads, num_v_heads, head_k, head_v, width, x, x.stride(0), conv_state,
             conv_weight, g, beta, rec_state, l2_eps, len(capture_tokens),
             torch.tensor(capture_tokens, dtype=torch.int64), torch.get_num_threads(),
             torch.empty((2 * width - 1 + tokens) * conv_dim), captured, final_state, core):
        raise ValueError(f"{kernel}: capture points out of range")
    return core, final_state, list(captured.unbind(0))

"""Host memory tuning for a serving process: the C allocator and Python's cyclic collector."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import logging
import sys
from collections.abc import Iterator

logger = logging.getLogger(__name__)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_RETAIN_BYTES = 1 << 30
_DEFAULT_THRESHOLD_BYTES = 128 << 10  # glibc's initial mmap and trim thresholds


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name is not None else None
    except OSError:
        return None


def allocator_free_bytes() -> int:
    """Bytes freed but kept by glibc's allocator for reuse (`mallinfo2().fordblks`; 0 before glibc 2.33)."""
    libc = _libc()
    mallinfo2 = getattr(libc, "mallinfo2", None)
    if mallinfo2 is None:
        return 0
    mallinfo2.restype = _MallInfo2
    return int(mallinfo2().fordblks)


def retain_freed_activation_memory() -> bool:
    """Raise glibc's mmap and trim thresholds so freed activations are reused; False without glibc."""
    libc = _libc()
    if libc is None:
        return False
    try:
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, _RETAIN_BYTES) == 1
                  and libc.mallopt(_M_TRIM_THRESHOLD, _RETAIN_BYTES) == 1)
    except (OSError, AttributeError):
        return False
    if not ok:
        logger.debug("mallopt refused the allocator thresholds")
    return ok


@contextlib.contextmanager
def freed_memory_returned() -> Iterator[None]:
    """While inside, large blocks are mapped on their own and freed ones go back to the system at
    once (glibc's default thresholds), so start-up's temporaries (weights being repacked) do not pile
    up; on the way out the serving thresholds of `retain_freed_activation_memory` are set again."""
    libc = _libc()
    if libc is None:
        yield
        return
    try:
        libc.mallopt(_M_MMAP_THRESHOLD, _DEFAULT_THRESHOLD_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_THRESHOLD_BYTES)
        yield
    finally:
        retain_freed_activation_memory()


def give_back_freed_memory() -> bool:
    """Return the heap that start-up (weight loading, the profiling forward) freed to the system
    (`malloc_trim`), so a process holds its weights and the pools it uses, not their scaffolding;
    False without glibc."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive now (a serving process once built, not library code)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

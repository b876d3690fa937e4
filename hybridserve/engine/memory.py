"""Host memory tuning for a serving process: the C allocator and Python's cyclic collector.

The CPU engine's heap (glibc) has two kinds of step to serve. A decode step allocates the same
tensors every time (a few rows, each sequence's gathered context), so it reuses freed heap memory
and never pays page faults: its allocations stay in the heap (`retain_freed_activation_memory`).
A prefill step allocates prompt-sized activations whose sizes change with every prompt; kept in
the heap, their freed blocks are split by small long-lived objects and later prompts extend the
heap past them, so a serving process's resident size climbed in steps for as long as new prompt
mixes arrived. Prefill steps therefore map each large allocation on its own, returned to the
system when freed (`prepare_step_heap`, called by each worker before every step), and the heap a
serving process keeps is what its decode steps reuse.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_RETAIN_BYTES = 1 << 30
_DEFAULT_THRESHOLD_BYTES = 128 << 10  # glibc's initial mmap and trim thresholds
# A prefill step maps every allocation above glibc's initial threshold on its own (fixed: set by
# mallopt, it no longer adapts), so prompt-sized activations never become heap.
_PREFILL_MMAP_THRESHOLD = _DEFAULT_THRESHOLD_BYTES


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


@dataclass
class _HeapMode:
    """What this process's allocator is set to (glibc's thresholds are process-wide)."""

    serving: bool = False   # `retain_freed_activation_memory` is in effect (glibc, a CPU engine)
    prefill: bool = False   # the mmap threshold is the prefill step's


_heap_mode = _HeapMode()


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
        ok = False
    if not ok:
        logger.debug("mallopt refused the allocator thresholds")
    _heap_mode.serving, _heap_mode.prefill = ok, False
    return ok


def step_mmap_threshold(prefills: bool) -> int:
    """The mmap threshold a step runs with: a prefill step maps its large allocations on their own
    (returned when freed), a decode step takes them from the kept heap."""
    return _PREFILL_MMAP_THRESHOLD if prefills else _RETAIN_BYTES


def prepare_step_heap(prefills: bool) -> bool:
    """Before a step: set the mmap threshold of its kind (`step_mmap_threshold`) when the previous
    step was of the other kind; a libc call, no system call. Does nothing unless the serving
    thresholds are in effect. Returns whether it changed the threshold."""
    if not _heap_mode.serving or prefills == _heap_mode.prefill:
        return False
    libc = _libc()
    if libc is None or libc.mallopt(_M_MMAP_THRESHOLD, step_mmap_threshold(prefills)) != 1:
        return False
    _heap_mode.prefill = prefills
    return True


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
        _heap_mode.serving = False
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

"""Process settings of an engine, applied at engine start, never at import (docs/cpu-kernels.md).
libgomp reads `OPENMP_ENVIRONMENT` only when it loads, so only processes hybridserve starts get it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

# Idle OpenMP workers spin briefly, then sleep: spinning ones stall every parallel region when another
# process holds a core. An explicit OMP_WAIT_POLICY in the environment wins, with its own spin count.
OPENMP_SPIN_COUNT = "1000"
OPENMP_ENVIRONMENT: dict[str, str] = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": OPENMP_SPIN_COUNT}

# oneDNN's and ideep's kernel caches: a prefill GEMM per row count, new on nearly every step, filled
# the default 1024 entries each with kernels used once; 64 hold several step sizes' linears.
ONEDNN_CACHE_CAPACITY = "64"
ONEDNN_ENVIRONMENT: dict[str, str] = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": ONEDNN_CACHE_CAPACITY,
                                      "LRU_CACHE_CAPACITY": ONEDNN_CACHE_CAPACITY}


@dataclass(frozen=True)
class ProcessSettings:
    """What `apply_process_settings` left in effect in this process."""

    num_threads: int
    heap_retains_freed_memory: bool
    onednn_environment: dict[str, str]


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def default_num_threads() -> int:
    """Every core this process may run on."""
    return available_cores()


def configure_threads(num_threads: int | None) -> int:
    """Set torch's intra-op thread count (`None`: the default) and return it."""
    import torch

    count = default_num_threads() if num_threads is None else num_threads
    if count < 1:
        raise ValueError(f"threads must be >= 1, got {count}")
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return count


def started_process_environment() -> dict[str, str]:
    """The OpenMP and oneDNN variables a process hybridserve starts gets, less those already set."""
    wanted = dict(ONEDNN_ENVIRONMENT)
    if "OMP_WAIT_POLICY" not in os.environ:
        wanted.update(OPENMP_ENVIRONMENT)
    return {name: value for name, value in wanted.items() if name not in os.environ}


def prepare_command_process() -> dict[str, str]:
    """For hybridserve's command line before torch loads (not library code): add the started-process environment."""
    added = started_process_environment()
    os.environ.update(added)
    return added


@contextlib.contextmanager
def child_process_environment() -> Iterator[dict[str, str]]:
    """Give a child started inside it `started_process_environment()`; restores this process's environment."""
    added = started_process_environment()
    os.environ.update(added)
    try:
        yield added
    finally:
        for name in added:
            os.environ.pop(name, None)


def apply_process_settings(num_threads: int | None, device_type: str = "cpu") -> ProcessSettings:
    """Set torch's thread count (`None`: every core), the CPU heap thresholds and oneDNN's cache sizes."""
    from hybridserve.engine.memory import retain_freed_activation_memory

    count = configure_threads(num_threads)
    retains = retain_freed_activation_memory() if device_type == "cpu" else False
    for name, value in ONEDNN_ENVIRONMENT.items():  # read when oneDNN builds its first kernel
        os.environ.setdefault(name, value)
    return ProcessSettings(count, retains, {name: os.environ[name] for name in ONEDNN_ENVIRONMENT})

"""Process settings of an engine: CPU threads, the heap allocator, oneDNN's kernel caches, and the
OpenMP environment of the processes hybridserve starts itself (docs/cpu-kernels.md explains each).

Nothing runs at import. `apply_process_settings` runs when an engine starts and sets what a running
process still can: torch's thread count (also the C kernels'), glibc's heap thresholds (CPU) and
oneDNN's cache capacities unless the user set them. libgomp reads `OPENMP_ENVIRONMENT` only when it
loads, so it is given to the processes hybridserve starts (`prepare_command_process`,
`child_process_environment`); in a user's process the user's environment decides.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

# Idle OpenMP workers first spin briefly (GOMP_SPINCOUNT, libgomp's count of pause loops), then
# sleep instead of spinning on: spinning workers stall every parallel region when another process
# holds a core, and waking a sleeping one costs tens of microseconds per region
# (`python -m benchmarks.threads`). An explicit OMP_WAIT_POLICY in the environment wins, with its own
# spin count.
OPENMP_SPIN_COUNT = "1000"
OPENMP_ENVIRONMENT: dict[str, str] = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": OPENMP_SPIN_COUNT}

# oneDNN (prefill GEMMs) compiles a kernel for every shape it meets and keeps it in two caches,
# oneDNN's own and PyTorch's (ideep), 1024 entries each by default. A prefill's row count is the
# step's token count, new on almost every step of real traffic, so both caches filled with kernels
# used once and a serving process grew without bound. 64 entries hold every linear of several step
# sizes at the same prefill speed (docs/benchmarks).
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
    """The variables a process hybridserve starts should get before torch loads in it: the OpenMP
    and oneDNN settings, less those already in this environment (an explicit OMP_WAIT_POLICY also
    keeps its own spin count)."""
    wanted = dict(ONEDNN_ENVIRONMENT)
    if "OMP_WAIT_POLICY" not in os.environ:
        wanted.update(OPENMP_ENVIRONMENT)
    return {name: value for name, value in wanted.items() if name not in os.environ}


def prepare_command_process() -> dict[str, str]:
    """For a process that hybridserve's own command line runs (before it imports torch): add
    `started_process_environment()` to this process's environment, which its children inherit.
    Returns what was added. Never call it from library code: it changes the caller's environment."""
    added = started_process_environment()
    os.environ.update(added)
    return added


@contextlib.contextmanager
def child_process_environment() -> Iterator[dict[str, str]]:
    """Around the start of a spawned child (engine core, tensor-parallel worker): the child's
    environment gets `started_process_environment()`, whatever the parent had imported; this
    process's environment is restored on exit. Yields what was added."""
    added = started_process_environment()
    os.environ.update(added)
    try:
        yield added
    finally:
        for name in added:
            os.environ.pop(name, None)


def _apply_onednn_environment() -> dict[str, str]:
    """Set oneDNN's cache capacities where unset (read when oneDNN builds its first kernel);
    returns the values in effect."""
    for name, value in ONEDNN_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in ONEDNN_ENVIRONMENT}


def apply_process_settings(num_threads: int | None, device_type: str = "cpu") -> ProcessSettings:
    """At engine start: torch's thread count (`None`: every available core), the heap allocator's
    thresholds on CPU, oneDNN's cache capacities. The one place an engine tunes its process."""
    from hybridserve.engine.memory import retain_freed_activation_memory

    count = configure_threads(num_threads)
    retains = retain_freed_activation_memory() if device_type == "cpu" else False
    return ProcessSettings(count, retains, _apply_onednn_environment())

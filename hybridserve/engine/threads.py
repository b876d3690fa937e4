"""CPU thread count of the forward: a default that survives a busy machine.

torch's default uses every core with OpenMP workers that spin while waiting. When another process
keeps one core busy, every parallel region then waits for the worker that shares that core: a
decode step measured here went from ~21 ms to ~550 ms (`hybridserve bench threads`). Idle workers
that sleep instead (`OMP_WAIT_POLICY=PASSIVE`, set by `import hybridserve` before torch loads)
remove most of it, and with them every core was the best default measured on this 2-core machine.
When torch was loaded before hybridserve, the wait policy could not be set, and the default leaves
one core free instead (a single thread has no workers to spin).
"""

from __future__ import annotations

import os

import torch

OMP_WAIT_POLICY_ENV = "OMP_WAIT_POLICY"


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def passive_wait_in_effect() -> bool:
    """Whether OpenMP's idle workers sleep: OMP_WAIT_POLICY=PASSIVE was in the environment when
    torch (and its OpenMP runtime) loaded, which hybridserve ensures when imported first."""
    import hybridserve

    policy = os.environ.get(OMP_WAIT_POLICY_ENV, "").strip().upper()
    return policy == "PASSIVE" and not hybridserve.TORCH_LOADED_BEFORE_HYBRIDSERVE


def default_num_threads() -> int:
    """Every available core when idle workers sleep; otherwise all cores but one (at least 1)."""
    cores = available_cores()
    return cores if passive_wait_in_effect() else max(1, cores - 1)


def configure_threads(num_threads: int | None) -> int:
    """Set torch's intra-op thread count (`None`: the default) and return it."""
    count = default_num_threads() if num_threads is None else num_threads
    if count < 1:
        raise ValueError(f"threads must be >= 1, got {count}")
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return count

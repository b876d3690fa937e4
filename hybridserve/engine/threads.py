"""CPU thread count of the forward: a default that survives a busy machine.

torch's default uses every core and OpenMP workers that spin while waiting. When another process
keeps one core busy, every parallel region then waits for the worker that shares that core: a
decode step measured here went from ~13 ms to over 400 ms. Leaving one core free (for the server's
event loop, the tokenizer and the rest of the machine) and letting idle OpenMP workers sleep
(`OMP_WAIT_POLICY=PASSIVE`, set before torch loads, see `hybridserve/__init__.py`) keeps decode
within a small factor of its idle speed; `hybridserve bench threads` measures it.
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


def default_num_threads() -> int:
    """All available cores but one (at least 1)."""
    return max(1, available_cores() - 1)


def configure_threads(num_threads: int | None) -> int:
    """Set torch's intra-op thread count (`None`: the default) and return it."""
    count = default_num_threads() if num_threads is None else num_threads
    if count < 1:
        raise ValueError(f"threads must be >= 1, got {count}")
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return count

"""hybridserve: a serving engine for hybrid (Gated DeltaNet + attention) LLMs with a joint prefix cache."""

import os
import sys

# Idle OpenMP workers sleep instead of spinning (read when the OpenMP runtime loads with torch, so
# it must be set before the first `import torch`); spinning workers stall every parallel region
# when another process holds a core. They first spin briefly (GOMP_SPINCOUNT, libgomp's count of
# pause loops, tens of microseconds): waking a sleeping worker cost ~55 us per parallel region on a
# 2-core KVM guest, and a decode step has dozens of regions a few microseconds apart
# (`hybridserve bench threads`). An explicit OMP_WAIT_POLICY in the environment wins, with its own
# spin count.
TORCH_LOADED_BEFORE_HYBRIDSERVE = "torch" in sys.modules
OPENMP_SPIN_COUNT = "1000"
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)

# oneDNN (prefill GEMMs) compiles a kernel for every shape it meets and keeps it in two caches,
# oneDNN's own and PyTorch's (ideep), 1024 entries each by default. A prefill's row count is the
# step's token count, new on almost every step of real traffic, so both caches filled with
# kernels used once: the engine process grew by ~950 MiB in a 4-minute soak, 1-2 MiB per kernel.
# 64 entries hold every linear of several step sizes; a random-length prefill ran at the same speed
# (3208-3339 against 3150-3304 tok/s, BENCHMARKS.md). Read when oneDNN makes its first kernel.
ONEDNN_CACHE_CAPACITY = "64"
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_CACHE_CAPACITY)
os.environ.setdefault("LRU_CACHE_CAPACITY", ONEDNN_CACHE_CAPACITY)

from hybridserve.sampling_params import CompletionOutput, RequestOutput, SamplingParams, StructuredOutputsParams  # noqa: E402,E501

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """`LLM` loads on first use, so processes that only need the model (tensor-parallel
    workers) do not import the engine, its grammar library and the tokenizer stack."""
    if name == "LLM":
        from hybridserve.api import LLM

        return LLM
    raise AttributeError(f"module 'hybridserve' has no attribute {name!r}")

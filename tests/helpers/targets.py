"""Where tests run: every test names its device and dtype explicitly (never `device="auto"`).

`CPU` (float32) is the default suite's target; `CUDA` (bfloat16) is used by the tests marked
`cuda`, which are skipped without a GPU. Tolerances per target are documented here and in
tests/README.md.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch


class Target(NamedTuple):
    """A device, a dtype and the tolerances results are held to there."""

    device: str
    dtype: str
    logit_atol: float        # max |logit difference| vs a float32 reference (or vs another path)
    greedy_margin: float     # a greedy token may differ only if the reference's top logit beats it by less

    def engine_kwargs(self) -> dict[str, str]:
        """`device=` and `dtype=` for `LLM(...)` / `EngineConfig(...)`."""
        return {"device": self.device, "dtype": self.dtype}

    def cli_args(self) -> list[str]:
        """The same as command-line flags."""
        return ["--device", self.device, "--dtype", self.dtype]


CPU = Target("cpu", "float32", logit_atol=1e-4, greedy_margin=0.0)
# bfloat16 keeps ~3 significant digits; the tiny random test models have logits of magnitude ~1-5,
# so 0.1 absolute bounds the rounding of 4-8 layers of bf16 GEMMs with float32 accumulation.
CUDA = Target("cuda", "bfloat16", logit_atol=1e-1, greedy_margin=1e-1)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

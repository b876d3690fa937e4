"""One copy of every weight: after packing, the bytes the model holds equal its parameter bytes."""

from __future__ import annotations

import math
import pytest
import torch

from hybridserve.config import CacheConfig, EngineConfig
from hybridserve.engine.engine import LLMEngine
from hybridserve.models.builtin import parameter_shapes


def _engine(model: str | None, dtype: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device="cpu", dtype=dtype,
                                  cache=CacheConfig(kv_cache_mib=4, prefix_cache_mib=0)))


def _parameter_bytes(engine: LLMEngine, element_size: int) -> int:
    """Bytes of the checkpoint's parameters in the serving dtype (tied embeddings once)."""
    shapes = parameter_shapes(engine.model_config)
    return sum(math.prod(shape) for shape in shapes.values()) * element_size


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fixture", [None, "text_checkpoint", "tied_text_checkpoint"])
def test_every_weight_is_held_once(fixture: str | None, dtype: str, request: pytest.FixtureRequest) -> None:
    model_dir = None if fixture is None else str(request.getfixturevalue(fixture))
    engine = _engine(model_dir, dtype)
    model = engine.runner.model
    element_size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    expected = _parameter_bytes(engine, element_size)
    held = model.weight_bytes()
    # RMSNorm scales (1 + w) and GDN decay rates (-exp(A_log)) are precomputed in float32; in
    # bf16 they are the only growth.
    float32_kept = [getattr(m, name) for m in model.modules() for name in ("scale", "neg_decay_rate")
                    if isinstance(getattr(m, name, None), torch.Tensor)]
    norm_growth = 0 if dtype == "float32" else sum(t.numel() * (4 - element_size) for t in float32_kept)
    assert held == expected + norm_growth, (held, expected)
    assert engine.weight_bytes == held
    # the Hugging Face-named linears are gone once packed; their memory lives in the packed GEMMs
    names = {name for name, _ in model.named_parameters()}
    assert not any(name.endswith(("q_proj.weight", "in_proj_qkv.weight", "gate_proj.weight")) for name in names)
    assert ("lm_head.weight" in names) is False


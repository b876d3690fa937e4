"""One copy of every weight: after packing, the bytes the model holds equal its parameter bytes."""

from __future__ import annotations

import math

import pytest
import torch

from hybridserve.config import CacheConfig, EngineConfig
from hybridserve.engine.engine import LLMEngine
from hybridserve.layers import huge_pages
from hybridserve.layers.linear import union_bytes
from hybridserve.models.builtin import parameter_shapes
from tests.helpers.greedy_runs import run_greedy


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



class _Holder:
    """Stands in for a packed linear: tensors held as plain attributes."""


def _big(rows: int) -> torch.Tensor:
    return torch.randn(rows, 1024)  # rows x 4 KiB


def test_move_to_huge_pages_keeps_values_views_and_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: True)  # also where THP is off
    module = torch.nn.Linear(1, 1)
    module.weight = torch.nn.Parameter(_big(512), requires_grad=False)  # 2 MiB
    parameter = module.weight
    holder = _Holder()
    holder.shared, holder.transposed = parameter.detach(), parameter.detach().t()
    holder.other, holder.small = _big(300), torch.randn(8)
    before = {name: getattr(holder, name).clone() for name in ("shared", "transposed", "other", "small")}
    small = holder.small
    slots = [(module, "weight", parameter)] + [(holder, name, getattr(holder, name)) for name in before]
    moved = huge_pages.move_to_huge_pages(slots, min_bytes=1 << 20)
    assert moved == (512 + 300) * 4096
    assert module.weight is parameter and torch.equal(parameter, before["shared"])
    assert parameter.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert holder.shared.data_ptr() == parameter.data_ptr()  # one copy behind the views of one storage
    assert torch.equal(holder.transposed, before["transposed"]) and holder.transposed.stride() == (1, 1024)
    assert torch.equal(holder.other, before["other"]) and holder.other.data_ptr() == parameter.data_ptr() + 512 * 4096
    assert holder.small is small  # under min_bytes: left alone
    holder.other.add_(1)  # the copies are ordinary writable tensors
    assert torch.equal(holder.other, before["other"] + 1) and torch.equal(parameter, before["shared"])


def test_huge_pages_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, "0")
    assert not huge_pages.huge_pages_available()
    holder = _Holder()
    holder.weight = tensor = _big(512)
    assert huge_pages.move_to_huge_pages([(holder, "weight", tensor)]) == 0 and holder.weight is tensor


def test_weights_in_huge_pages_decode_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-in model's weights moved (its linears are 1-3 MiB each) and not: the same greedy
    tokens (one row: the C step; five: a prefill), the same weight bytes."""
    prompts = {"one": [11], "five": [11, 12, 13, 14, 15]}
    runs, sizes = [], []
    for available in (True, False):
        monkeypatch.setattr(huge_pages, "huge_pages_available", lambda available=available: available)
        engine = _engine(None, "float32")
        runs.append(run_greedy(engine, prompts, max_tokens=12))
        sizes.append(engine.weight_bytes)
        large = [t.data_ptr() for _, _, t in engine.runner.model.weight_slots() if t.numel() * 4 >= 1 << 20]
        in_one_region = min(large) % huge_pages.HUGE_PAGE_BYTES == 0 and max(large) - min(large) < engine.weight_bytes
        assert len(large) >= 20 and in_one_region == available
    assert runs[0] == runs[1] and sizes[0] == sizes[1]


def test_union_bytes_counts_shared_memory_once() -> None:
    base = torch.zeros(100)
    assert union_bytes([base, base[:50], base[25:75]]) == 400
    assert union_bytes([base[:10], base[90:]]) == 80
    assert union_bytes([base, torch.zeros(10), torch.zeros(0)]) == 440
    assert union_bytes([base.view(10, 10).t()]) == 400

"""Longer cases, deselected by default (`make test-all` or `pytest -m slow` runs them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.models.builtin import save_builtin_checkpoint
from tests.helpers.checkpoints import reference_text_model
from tests.helpers.prefix_cache import check_multi_turn_cache_on_equals_off, check_random_configuration
from tests.helpers.targets import CPU

pytestmark = pytest.mark.slow


def test_builtin_model_parity_on_a_long_prompt(tmp_path: Path) -> None:
    """The built-in model's shape, saved as a HF checkpoint: transformers agrees over 1100 tokens."""
    path = save_builtin_checkpoint(tmp_path / "builtin")
    reference = reference_text_model(path)
    prompt = torch.randint(0, 4096, (1100,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref_logits = reference(torch.tensor([prompt])).logits[0]
    llm = LLM(model=str(path), **CPU.engine_kwargs(), kv_cache_mib=32, prefix_cache_mib=0)
    ours = llm.llm_engine.prompt_logits(prompt)
    assert (ours - ref_logits).abs().max().item() <= 1e-4
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].outputs[0]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(16):
            ids = torch.cat([ids, reference(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    assert out.token_ids == ids[0, len(prompt):].tolist()
    llm.llm_engine.check_integrity()


@pytest.mark.parametrize("seed", range(2, 8))
def test_differential_multi_turn_more_seeds(text_checkpoint: Path, seed: int) -> None:
    check_multi_turn_cache_on_equals_off(text_checkpoint, seed)


@pytest.mark.parametrize("seed", range(100, 200))
def test_differential_random_configurations_more_seeds(text_checkpoint: Path, seed: int) -> None:
    check_random_configuration(text_checkpoint, seed)

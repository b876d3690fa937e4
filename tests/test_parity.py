"""Numerical parity with transformers' Qwen3_5ForCausalLM on tiny random checkpoints loaded from disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from tests.checkpoints import make_text_checkpoint, reference_text_model

SHAPES = {
    "base": dict(),
    "tied-interval2": dict(tie=True, heads=8, kv_heads=4, head_dim=8, full_attention_interval=2, seed=1),
    "wide-gdn-interval3": dict(hidden=96, layers=6, heads=6, kv_heads=2, head_dim=16, lin_k_heads=4,
                               lin_v_heads=4, lin_k_dim=32, lin_v_dim=16, full_attention_interval=3, seed=2),
    "mqa-gdn-gqa": dict(hidden=48, layers=5, heads=4, kv_heads=1, head_dim=32, lin_k_heads=1, lin_v_heads=3,
                        lin_k_dim=16, lin_v_dim=24, full_attention_interval=5, seed=3),
}
PROMPT_LENGTHS = (9, 77, 150)


def _prompts(vocab: int = 4096) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@torch.no_grad()
def _reference_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    ids = torch.tensor([prompt])
    first_logits = model(ids).logits[0]
    tokens = []
    for _ in range(steps):
        token = int(model(ids).logits[0, -1].argmax())
        tokens.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return first_logits, tokens


def _check_parity(path: Path) -> None:
    reference = reference_text_model(path)
    llm = LLM(model=str(path), kv_cache_mib=16, prefix_cache_mib=0)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for prompt in _prompts():
        ref_logits, ref_tokens = _reference_greedy(reference, prompt, 32)
        ours = llm.llm_engine.prompt_logits(prompt)
        assert (ours - ref_logits).abs().max().item() <= 1e-4
        out = llm.generate([prompt], params)[0].outputs[0]
        assert out.token_ids == ref_tokens
    llm.llm_engine.check_integrity()


@pytest.mark.parametrize("name", list(SHAPES))
def test_text_checkpoint_parity(name: str, tmp_path: Path) -> None:
    _check_parity(make_text_checkpoint(tmp_path / name, **SHAPES[name]))


def test_multimodal_checkpoint_parity(multimodal_checkpoint: Path) -> None:
    _check_parity(multimodal_checkpoint)


def test_sharded_checkpoint_parity(sharded_checkpoint: Path) -> None:
    _check_parity(sharded_checkpoint)

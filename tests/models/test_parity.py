"""Numerical parity with transformers' Qwen3_5ForCausalLM on tiny random checkpoints loaded from disk."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.models.builtin import save_builtin_checkpoint
from tests.helpers.checkpoints import make_text_checkpoint, pin_torch_path, reference_text_model
from tests.helpers.targets import CPU, CUDA, Target, requires_cuda

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


@torch.no_grad()
def _assert_greedy_close(model: torch.nn.Module, prompt: list[int], tokens: list[int], margin: float) -> None:
    """Each of our greedy tokens is the reference's argmax, or within `margin` of its top logit
    (bf16 may break near-ties differently), judged on the reference given our own prefix."""
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert (logits.max(dim=-1).values - chosen).max().item() <= margin


def _check_parity(path: Path, target: Target = CPU) -> None:
    """Our engine on `target` against transformers in float32 on CPU: prompt logits within the
    target's tolerance, greedy continuation equal (CPU) or within the greedy margin (bf16)."""
    reference = reference_text_model(path)
    llm = LLM(model=str(path), **target.engine_kwargs(), kv_cache_mib=16, prefix_cache_mib=0)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for prompt in _prompts():
        ref_logits, ref_tokens = _reference_greedy(reference, prompt, 32)
        ours = llm.llm_engine.prompt_logits(prompt).cpu()
        assert (ours - ref_logits).abs().max().item() <= target.logit_atol
        out = llm.generate([prompt], params)[0].outputs[0]
        if target.greedy_margin == 0.0:
            assert out.token_ids == ref_tokens
        else:
            _assert_greedy_close(reference, prompt, out.token_ids, target.greedy_margin)
    llm.llm_engine.check_integrity()


@pytest.mark.parametrize("name", list(SHAPES))
def test_text_checkpoint_parity(name: str, tmp_path: Path) -> None:
    _check_parity(make_text_checkpoint(tmp_path / name, **SHAPES[name]))


def test_multimodal_checkpoint_parity(multimodal_checkpoint: Path) -> None:
    _check_parity(multimodal_checkpoint)


def test_sharded_checkpoint_parity(sharded_checkpoint: Path) -> None:
    _check_parity(sharded_checkpoint)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("name", list(SHAPES))
def test_text_checkpoint_parity_cuda_bf16(name: str, tmp_path: Path) -> None:
    _check_parity(make_text_checkpoint(tmp_path / name, **SHAPES[name]), CUDA)


@pytest.mark.slow
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


def _fla_kernel() -> None:
    """Stands in for a flash-linear-attention kernel bound to a layer."""


def test_the_reference_runs_transformers_own_gdn_functions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Older transformers bind fla's kernels and a fused gated norm to each GDN layer whenever fla
    imports; the reference rebinds them to the release's PyTorch functions and plain norm. A fake
    modeling module and layer stand in for such a release."""
    fake = types.ModuleType("fake_qwen3_5_modeling")

    def torch_chunk_gated_delta_rule() -> None: ...
    def torch_recurrent_gated_delta_rule() -> None: ...
    def torch_causal_conv1d_update() -> None: ...

    class Qwen3_5RMSNormGated(torch.nn.Module):
        def __init__(self, dim: int, eps: float) -> None:
            super().__init__()
            self.weight, self.eps = torch.nn.Parameter(torch.ones(dim)), eps

    class FusedNorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.full((4,), 2.0))

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head_v_dim, self.layer_norm_epsilon, self.norm = 4, 1e-6, FusedNorm()
            self.chunk_gated_delta_rule = self.recurrent_gated_delta_rule = _fla_kernel
            self.causal_conv1d_update = self.causal_conv1d_fn = _fla_kernel

    for item in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule, torch_causal_conv1d_update,
                 Qwen3_5RMSNormGated):
        setattr(fake, item.__name__, item)
    class Model(torch.nn.Sequential):
        """The model class, defined in the fake modeling module."""

    Model.__module__ = fake.__name__
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    model = Model(Layer())
    layer = pin_torch_path(model)[0]
    assert layer.chunk_gated_delta_rule is torch_chunk_gated_delta_rule
    assert layer.recurrent_gated_delta_rule is torch_recurrent_gated_delta_rule
    assert layer.causal_conv1d_update is torch_causal_conv1d_update and layer.causal_conv1d_fn is None
    assert isinstance(layer.norm, Qwen3_5RMSNormGated) and layer.norm.eps == 1e-6
    assert torch.equal(layer.norm.weight, torch.full((4,), 2.0))

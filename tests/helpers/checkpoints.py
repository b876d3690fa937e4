"""Tiny random Qwen3.5 checkpoints built with transformers, for tests.

Each builder saves with `save_pretrained` (Hugging Face layout) and adds the built-in tokenizer
files so the engine can tokenize. Weights are deterministic for a given seed, and the global torch
RNG is left untouched.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from hybridserve.models.tokenizer import ENDOFTEXT_ID, IM_END_ID, Tokenizer

FAKE_MTP_TENSORS = ("mtp.fc.weight", "mtp.layers.0.input_layernorm.weight")


def _quiet_transformers() -> None:
    """Silence transformers' loading bars and kernel-fallback warnings."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def text_config(
    *, hidden: int = 64, layers: int = 4, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
    lin_k_heads: int = 2, lin_v_heads: int = 4, lin_k_dim: int = 16, lin_v_dim: int = 16,
    intermediate: int = 128, vocab: int = 4096, tie: bool = False, full_attention_interval: int = 4,
) -> Any:
    """A tiny `transformers.Qwen3_5TextConfig`."""
    from transformers import Qwen3_5TextConfig

    layer_types = ["full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
                   for i in range(layers)]
    return Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        linear_num_key_heads=lin_k_heads, linear_num_value_heads=lin_v_heads,
        linear_key_head_dim=lin_k_dim, linear_value_head_dim=lin_v_dim, layer_types=layer_types,
        tie_word_embeddings=tie, eos_token_id=[ENDOFTEXT_ID, IM_END_ID],
    )


def _randomize_text_weights(model: torch.nn.Module) -> None:
    """Make norms, gates and decay parameters non-trivial so tests exercise them."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("linear_attn.norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("norm.weight"):
                param.normal_(0.0, 0.1)
            elif name.endswith("dt_bias"):
                param.copy_(1.0 + 0.5 * torch.randn_like(param))
            elif name.endswith("A_log"):
                param.uniform_(1.0, 16.0).log_()
            elif name.endswith("conv1d.weight"):
                param.normal_(0.0, 0.3)


def make_text_checkpoint(
    path: str | Path, *, seed: int = 0, max_shard_size: int | str | None = None, **shape: Any
) -> Path:
    """Save a random text-only `Qwen3_5ForCausalLM` (keyword shape args as `text_config`) plus
    the built-in tokenizer files into `path`; `max_shard_size` makes a sharded checkpoint."""
    from transformers import Qwen3_5ForCausalLM

    _quiet_transformers()
    config = text_config(**shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5ForCausalLM(config).float()
        _randomize_text_weights(model)
    out = Path(path)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    Tokenizer.byte_level(config.vocab_size).save(out)
    return out


def make_multimodal_checkpoint(path: str | Path, *, seed: int = 0, **shape: Any) -> Path:
    """Save a random multimodal `Qwen3_5ForConditionalGeneration` (tiny vision tower) plus fake
    `mtp.*` tensors and the built-in tokenizer files into `path`."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    _quiet_transformers()
    text = text_config(**shape)
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "out_hidden_size": text.hidden_size, "patch_size": 4, "num_position_embeddings": 16}
    config = Qwen3_5Config(text_config=text.to_dict(), vision_config=vision,
                           tie_word_embeddings=text.tie_word_embeddings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5ForConditionalGeneration(config).float()
        _randomize_text_weights(model)
    out = Path(path)
    model.save_pretrained(out)
    _add_fake_mtp_tensors(out / "model.safetensors", text.hidden_size)
    Tokenizer.byte_level(text.vocab_size).save(out)
    return out


def _add_fake_mtp_tensors(file: Path, hidden: int) -> None:
    """Rewrite a safetensors file with extra multi-token-prediction tensors (to be ignored)."""
    tensors = load_file(str(file))
    tensors[FAKE_MTP_TENSORS[0]] = torch.randn(hidden, 2 * hidden)
    tensors[FAKE_MTP_TENSORS[1]] = torch.randn(hidden)
    save_file(tensors, str(file), metadata={"format": "pt"})


def rewrite_tensors(file: Path, *, drop: tuple[str, ...] = (), add: dict[str, torch.Tensor] | None = None) -> None:
    """Rewrite a safetensors file without the `drop` tensors and with the `add` ones."""
    tensors = {k: v for k, v in load_file(str(file)).items() if k not in drop}
    tensors.update(add or {})
    save_file(tensors, str(file), metadata={"format": "pt"})


def reference_text_model(path: str | Path) -> torch.nn.Module:
    """The transformers `Qwen3_5ForCausalLM` (float32, eval) of a text-only or multimodal dir:
    the reference for parity tests, loaded by transformers itself, not by hybridserve."""
    from transformers import Qwen3_5ForCausalLM

    _quiet_transformers()
    return pin_torch_path(Qwen3_5ForCausalLM.from_pretrained(Path(path), dtype=torch.float32).eval())


# GDN-layer attributes that transformers releases before its hub-kernel rewrite bind at construction
# to flash-linear-attention's kernels whenever fla imports, and their PyTorch fallbacks there.
_TORCH_FALLBACKS = {"chunk_gated_delta_rule": "torch_chunk_gated_delta_rule",
                    "recurrent_gated_delta_rule": "torch_recurrent_gated_delta_rule",
                    "causal_conv1d_update": "torch_causal_conv1d_update"}


def pin_torch_path(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every GDN layer on transformers' own PyTorch functions and gated norm. Older
    transformers bind fla's Triton kernels (and a fused norm placed on the current CUDA device) to
    each layer whenever fla imports, even for a CPU model: on a machine with a GPU, where fla is
    installed for the engine, the float32 CPU reference would run them. Newer releases bind
    nothing to the layers, and this changes nothing there."""
    modeling = sys.modules[type(model).__module__]
    plain_norm = getattr(modeling, "Qwen3_5RMSNormGated", None)
    for module in model.modules():
        attributes = vars(module)
        for name, fallback in _TORCH_FALLBACKS.items():
            if name in attributes and hasattr(modeling, fallback):
                setattr(module, name, getattr(modeling, fallback))
        if "causal_conv1d_fn" in attributes:
            module.causal_conv1d_fn = None  # the layer then runs its own nn.Conv1d
        norm = getattr(module, "norm", None)
        if plain_norm is not None and "head_v_dim" in attributes and not isinstance(norm, plain_norm):
            replacement = plain_norm(module.head_v_dim, eps=module.layer_norm_epsilon)
            with torch.no_grad():
                replacement.weight.copy_(norm.weight.detach().to("cpu", torch.float32))
            module.norm = replacement
    return model


def fresh_text_model(path: str | Path) -> torch.nn.Module:
    """A NaN-filled transformers `Qwen3_5ForCausalLM` shaped like the checkpoint at `path`
    (its parameter names are the ones hybridserve's model uses)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    _quiet_transformers()
    config = Qwen3_5TextConfig.from_pretrained(Path(path))
    with torch.random.fork_rng(devices=[]):
        model = Qwen3_5ForCausalLM(config).float().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))
    return model

"""The built-in default model: a small random Qwen3.5 hybrid used when no model dir is given.

Deterministic and download-free: the config, the byte-level tokenizer and the weights (seeded per
tensor name, independent of parameter order); `save_checkpoint` writes a Hugging Face style dir.
"""

from __future__ import annotations

import functools
import json
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from hybridserve.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from hybridserve.models.qwen3_5 import Qwen3_5ForCausalLM
from hybridserve.models.tokenizer import ENDOFTEXT_ID, IM_END_ID, IM_START_ID, Tokenizer

BUILTIN_MODEL_CONFIG = ModelConfig(
    vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
    linear_value_head_dim=64, rope_theta=10_000_000.0, tie_word_embeddings=True,
    # full_attention_interval 4: layers 3 and 7 are full attention.
    layer_types=tuple(FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(8)),
    eos_token_ids=(ENDOFTEXT_ID, IM_END_ID),  # the other fields keep ModelConfig's defaults (Qwen3.5's)
)

WEIGHT_STD = 0.02
CONV_STD = 0.3
A_RANGE = (1.0, 16.0)
RARE_ROW_SCALE = 0.05  # embedding rows of ids that should rarely be sampled (specials, raw bytes)


def builtin_tokenizer() -> Tokenizer:
    """A fresh instance of the built-in byte-level tokenizer."""
    return Tokenizer.byte_level(BUILTIN_MODEL_CONFIG.vocab_size)


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the text decoder's parameters (Hugging Face `Qwen3_5ForCausalLM`
    names; `lm_head.weight` only when embeddings are not tied), read off the model on the meta device."""
    return dict(_parameter_shapes(config))


@functools.lru_cache(maxsize=8)
def _parameter_shapes(config: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(config, max_positions=1)
    return tuple((name, tuple(parameter.shape)) for name, parameter in model.named_parameters())


def builtin_init_tensor(
    name: str, shape: tuple[int, ...], seed: int = 0, *, rare_ids: list[int] | None = None
) -> torch.Tensor:
    """Deterministic float32 CPU initial value of parameter `name` (seeded by seed and name); embedding
    rows of `rare_ids` are scaled down so the tied head rarely samples them and output reads as text."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    # the gated norm multiplies by w directly, the zero-centred RMSNorm by (1 + w)
    for suffix, value in (("linear_attn.norm.weight", 1.0), ("norm.weight", 0.0), ("dt_bias", 1.0), (".bias", 0.0)):
        if name.endswith(suffix):
            return torch.full(shape, value)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(*A_RANGE, generator=generator).log_()
    if name.endswith("conv1d.weight"):
        return torch.empty(shape).normal_(0.0, CONV_STD, generator=generator)
    if len(shape) < 2:
        raise ValueError(f"no built-in initialisation rule for parameter {name!r} of shape {list(shape)}")
    weight = torch.empty(shape).normal_(0.0, WEIGHT_STD, generator=generator)
    if rare_ids and name in ("model.embed_tokens.weight", "lm_head.weight"):
        weight[rare_ids] *= RARE_ROW_SCALE
    return weight


def rare_token_ids() -> list[int]:
    """Built-in ids that should rarely be sampled: the special tokens, and bytes that alone decode to no
    visible character (control bytes but newline, and 0x7F-0xFF: parts of multi-byte characters)."""
    control = [b for b in range(0x20) if b != ord("\n")]
    return [*control, *range(0x7F, 0x100), ENDOFTEXT_ID, IM_START_ID, IM_END_ID]


def init_builtin_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Fill every parameter of `model` with its built-in random value (on its device/dtype)."""
    rare_ids = rare_token_ids()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(builtin_init_tensor(name, tuple(param.shape), seed, rare_ids=rare_ids))


def builtin_state_dict(config: ModelConfig = BUILTIN_MODEL_CONFIG, seed: int = 0) -> dict[str, torch.Tensor]:
    """The built-in random weights of `config` as a float32 state dict (no model needed)."""
    rare_ids = rare_token_ids()
    return {name: builtin_init_tensor(name, shape, seed, rare_ids=rare_ids)
            for name, shape in parameter_shapes(config).items()}


def hf_config_dict(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A `config.json` dict (model_type `qwen3_5_text`) that transformers and
    `ModelConfig.from_hf_dict` both read back as `config`."""
    eos = list(config.eos_token_ids)
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        **{name: getattr(config, name) for name in _HF_CONFIG_FIELDS},
        "layer_types": list(config.layer_types),
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta,
                            "partial_rotary_factor": config.partial_rotary_factor},
        "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None,
        "dtype": str(dtype).removeprefix("torch."),
    }


# ModelConfig fields that config.json holds under the same name
_HF_CONFIG_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "rms_norm_eps",
                     "max_position_embeddings", "tie_word_embeddings", "attention_bias", "hidden_act", "bos_token_id")


def save_checkpoint(
    out_dir: str | Path, config: ModelConfig, state_dict: dict[str, torch.Tensor], tokenizer: Tokenizer
) -> Path:
    """Write a Hugging Face style model dir: config.json, generation_config.json,
    model.safetensors (a tied `lm_head.weight` is left out) and the tokenizer files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: tensor.detach().to("cpu").contiguous()
        for name, tensor in state_dict.items()
        if not (config.tie_word_embeddings and name == "lm_head.weight")
    }
    dtype = next(iter(tensors.values())).dtype if tensors else torch.float32
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_dict(config, dtype), indent=2) + "\n")
    generation = {"eos_token_id": list(config.eos_token_ids), "bos_token_id": config.bos_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save(out)
    return out


def save_builtin_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the built-in model (weights of `seed`) and tokenizer as a Hugging Face model dir."""
    return save_checkpoint(out_dir, BUILTIN_MODEL_CONFIG, builtin_state_dict(seed=seed), builtin_tokenizer())


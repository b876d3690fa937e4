"""Model shapes the simulator can cost: published Qwen3.5 text configs and the built-in model.

Only the shape matters (no weights): bytes of KV per token, bytes of one GDN snapshot, and the
prefill FLOPs a hit saves. KV and conv state in bfloat16, recurrent state in float32 (as served
on accelerators).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch

from hybridserve.cache.policy import PrefixCost
from hybridserve.cache.state_tensors import GDNStateTensors
from hybridserve.config import ModelConfig
from hybridserve.layers.attention import PagedKVCache
from hybridserve.models.builtin import BUILTIN_MODEL_CONFIG


def _qwen35(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, value_heads: int,
            tie: bool) -> ModelConfig:
    """A Qwen3.5 dense text config (head dim 256, GDN key heads 16 x 128, every 4th layer attention)."""
    return ModelConfig.from_hf_dict({
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": 256, "linear_num_key_heads": 16,
        "linear_num_value_heads": value_heads, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "tie_word_embeddings": tie,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    })


MODEL_SHAPES: dict[str, ModelConfig] = {
    "qwen3.5-0.8b": _qwen35(1024, 3584, 24, 8, 2, 16, tie=True),
    "qwen3.5-4b": _qwen35(2560, 9216, 32, 16, 4, 32, tie=False),
    "qwen3.5-27b": _qwen35(5120, 17408, 64, 24, 4, 48, tie=False),
    "builtin": BUILTIN_MODEL_CONFIG,
}


class ModelShape(NamedTuple):
    """A named model config and what its cache entries cost."""

    name: str
    config: ModelConfig
    cost: PrefixCost


def model_shape(name: str, dtype: torch.dtype = torch.bfloat16) -> ModelShape:
    """A shape from MODEL_SHAPES or a path to a Hugging Face config.json (ValueError otherwise)."""
    if name in MODEL_SHAPES:
        config = MODEL_SHAPES[name]
    elif Path(name).is_file():
        try:
            config = ModelConfig.from_hf_dict(json.loads(Path(name).read_text(encoding="utf-8")))
        except (json.JSONDecodeError, KeyError) as error:
            raise ValueError(f"{name}: not a Qwen3.5 config.json ({error})") from None
    else:
        raise ValueError(f"unknown model shape {name!r}: use one of {', '.join(MODEL_SHAPES)} "
                         f"or a path to a config.json")
    kv = PagedKVCache.bytes_per_token(len(config.attention_layer_ids), config.num_key_value_heads,
                                      config.head_dim, dtype)
    snapshot = GDNStateTensors.bytes_per_slot(config, dtype)
    return ModelShape(name, config, PrefixCost.from_model(config, kv, snapshot))

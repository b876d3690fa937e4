"""Tensor-parallel layout of a Qwen3.5 hybrid model as vLLM and SGLang split it (docs/serving.md):
each rank builds an ordinary model of `local_config`; `shard_spec` says which part of each full
tensor it reads."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from hybridserve.config import ModelConfig


class ShardSpec(NamedTuple):
    """A rank's part of one tensor: `ranges` along `dim`, concatenated (None: the whole tensor).
    `zero` marks a row-parallel bias that only rank 0 adds (the all-reduce sums it once)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    zero: bool = False


def validate_tensor_parallel(config: ModelConfig, world_size: int, device_type: str = "cpu",
                             num_devices: int | None = None) -> None:
    """Raise ValueError (saying why) when `config` cannot be split over `world_size` ranks."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
    if world_size == 1:
        return
    checks = (("num_attention_heads", config.num_attention_heads),
              ("linear_num_key_heads", config.linear_num_key_heads),
              ("linear_num_value_heads", config.linear_num_value_heads),
              ("intermediate_size", config.intermediate_size))
    for name, value in checks:
        if world_size > value:
            raise ValueError(f"tensor_parallel_size {world_size} is larger than the model's {name} ({value}): "
                             f"every rank needs at least one")
        if value % world_size:
            raise ValueError(f"tensor_parallel_size {world_size} does not divide the model's {name} ({value})")
    kv = config.num_key_value_heads
    if kv % world_size and world_size % kv:
        raise ValueError(f"tensor_parallel_size {world_size} and num_key_value_heads {kv} must divide one another "
                         f"(KV heads are split, or replicated when there are fewer than ranks)")
    if device_type == "cuda" and num_devices is not None and world_size > num_devices:
        raise ValueError(f"tensor_parallel_size {world_size} needs {world_size} GPUs, but {num_devices} are visible")
    if device_type == "cpu" and num_devices is not None and world_size > num_devices:
        raise ValueError(f"tensor_parallel_size {world_size} is larger than the {num_devices} available CPU cores "
                         f"(each rank needs at least one thread)")


def local_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The shape one rank's model has: head counts and the MLP width divided by the world size."""
    if world_size == 1:
        return config
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // world_size,
        num_key_value_heads=max(1, config.num_key_value_heads // world_size),
        linear_num_key_heads=config.linear_num_key_heads // world_size,
        linear_num_value_heads=config.linear_num_value_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
    )


def shard_spec(name: str, config: ModelConfig, rank: int, world_size: int) -> ShardSpec | None:
    """Which part of the full tensor `name` (model parameter name) rank `rank` holds."""
    if world_size == 1:
        return None
    local = local_config(config, world_size)
    part = name.rsplit(".", 2)
    owner, leaf = (part[-2], part[-1]) if len(part) >= 2 else ("", name)

    def block(size: int, offset: int = 0) -> tuple[int, int]:
        return offset + rank * size, offset + (rank + 1) * size

    if ".self_attn." in name:
        d = config.head_dim
        if owner == "q_proj":
            return ShardSpec(0, (block(2 * local.num_attention_heads * d),))
        if owner in ("k_proj", "v_proj"):
            if config.num_key_value_heads >= world_size:
                return ShardSpec(0, (block(local.num_key_value_heads * d),))
            head = rank // (world_size // config.num_key_value_heads)
            return ShardSpec(0, ((head * d, (head + 1) * d),))
        if owner == "o_proj":
            if leaf == "bias":
                return ShardSpec(0, (), zero=rank != 0)
            return ShardSpec(1, (block(local.num_attention_heads * d),))
        return None
    if ".linear_attn." in name:
        kd, vd = local.gdn_key_dim, local.gdn_value_dim
        if owner in ("in_proj_qkv", "conv1d"):
            return ShardSpec(0, (block(kd), block(kd, config.gdn_key_dim), block(vd, 2 * config.gdn_key_dim)))
        if owner == "in_proj_z":
            return ShardSpec(0, (block(vd),))
        if owner in ("in_proj_b", "in_proj_a") or leaf in ("dt_bias", "A_log"):
            return ShardSpec(0, (block(local.linear_num_value_heads),))
        if owner == "out_proj":
            return ShardSpec(1, (block(vd),))
        return None
    if ".mlp." in name:
        if owner in ("gate_proj", "up_proj"):
            return ShardSpec(0, (block(local.intermediate_size),))
        if owner == "down_proj":
            return ShardSpec(1, (block(local.intermediate_size),))
    return None


def local_shape(full_shape: tuple[int, ...], spec: ShardSpec | None) -> tuple[int, ...]:
    """Shape of a rank's part of a tensor of `full_shape`."""
    if spec is None or not spec.ranges:
        return full_shape
    shape = list(full_shape)
    shape[spec.dim] = sum(stop - start for start, stop in spec.ranges)
    return tuple(shape)


def read_shard(source: Any, full_shape: tuple[int, ...], spec: ShardSpec | None) -> torch.Tensor:
    """Read a rank's part from `source` (a tensor, or a safetensors slice: only that part is read)."""
    if spec is None:
        return source[tuple(slice(None) for _ in full_shape)] if not isinstance(source, torch.Tensor) else source
    if not spec.ranges:  # a row-parallel bias: rank 0 holds it, the others add zeros
        whole = source if isinstance(source, torch.Tensor) else source[:]
        return torch.zeros_like(whole) if spec.zero else whole
    parts = []
    for start, stop in spec.ranges:
        index = tuple(slice(start, stop) if d == spec.dim else slice(None) for d in range(len(full_shape)))
        parts.append(source[index])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.dim)

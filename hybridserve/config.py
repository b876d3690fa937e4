"""Configuration dataclasses, validated once at construction.

`ModelConfig` describes the Qwen3.5 text decoder (read from a Hugging Face `config.json`,
text-only or multimodal layout); `CacheConfig` sizes the KV pool and the GDN snapshot pool;
`SchedulerConfig` bounds batching. Every invalid value raises `ValueError` naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from hybridserve.cache.tier_dir import check_disk_cache_dir  # torch-free; raises a ValueError

POLICY_NAMES = ("hybridserve", "hybridserve-adaptive", "marconi", "interval", "last-block")  # cache/policy.py
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
BLOCK_HASHES = ("xxh3_128", "sha256")
TIER_WRITE_POLICIES = ("write-back", "write-through")  # see hybridserve.cache.tier_store
MIB = 1 << 20
# CPU cache sizes when nothing is given (why fixed: docs/serving.md, Sizing). Here, not in
# engine.memory_plan, so the command-line flags can name them without importing torch.
DEFAULT_CPU_KV_CACHE_MIB = 1024.0
DEFAULT_CPU_PREFIX_CACHE_MIB = 1024.0
_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000 ** 2, "mb": 1000 ** 2,
               "mib": MIB, "g": 1000 ** 3, "gb": 1000 ** 3, "gib": 1 << 30, "t": 1000 ** 4, "tb": 1000 ** 4,
               "tib": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from '4GiB', '512MiB', '1.5G', '1000000' (decimal and binary units, case-insensitive)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"invalid size {text!r}; use bytes or a unit such as 512MiB, 4GiB, 2G")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def redact_url(url: str) -> str:
    """`url` without its password (for logs and errors)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def check_remote_cache_url(url: str) -> None:
    """`ValueError` unless `url` is `redis://[:PASSWORD@]HOST[:PORT][/DB]` (or `rediss://`, `unix://`)."""
    parts = urlsplit(url)
    _require(parts.scheme in ("redis", "rediss", "unix"),
             f"--remote-cache-url must be redis://HOST:PORT/DB, got {redact_url(url)!r}")
    _require(parts.scheme == "unix" or bool(parts.hostname), f"--remote-cache-url names no host: {redact_url(url)!r}")
    database = parts.path.strip("/")
    _require(parts.scheme == "unix" or not database or database.isdigit(),
             f"--remote-cache-url's database must be a number, got {database!r}")
    try:
        parts.port
    except ValueError as error:
        raise ValueError(f"--remote-cache-url: {error}") from None


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Qwen3.5 hybrid text decoder (names follow the Hugging Face config)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
            "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim", "max_position_embeddings",
        ):
            _require(getattr(self, name) >= 1, f"model config: {name} must be >= 1, got {getattr(self, name)}")
        _require(len(self.layer_types) == self.num_hidden_layers,
                 f"model config: layer_types has {len(self.layer_types)} entries, "
                 f"num_hidden_layers is {self.num_hidden_layers}")
        bad = set(self.layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION}
        _require(not bad, f"model config: unknown layer types {sorted(bad)}")
        _require(self.num_attention_heads % self.num_key_value_heads == 0,
                 "model config: num_attention_heads must be a multiple of num_key_value_heads")
        _require(self.linear_num_value_heads % self.linear_num_key_heads == 0,
                 "model config: linear_num_value_heads must be a multiple of linear_num_key_heads")
        _require(self.hidden_act == "silu", f"model config: hidden_act {self.hidden_act!r} is not supported")
        _require(0.0 < self.partial_rotary_factor <= 1.0, "model config: partial_rotary_factor must be in (0, 1]")
        _require(self.rotary_dim % 2 == 0 and self.rotary_dim > 0,
                 f"model config: rotary dim {self.rotary_dim} must be a positive even number")

    @property
    def rotary_dim(self) -> int:
        """Number of leading head dimensions that get rotary embedding."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def gdn_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the depthwise causal conv (q, k and v concatenated)."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict (text-only or multimodal with `text_config`)."""
        model_type = raw.get("model_type")
        _require(model_type in SUPPORTED_MODEL_TYPES,
                 f"unsupported model_type {model_type!r}; expected one of {SUPPORTED_MODEL_TYPES}")
        text: dict[str, Any] = dict(raw.get("text_config") or raw) if model_type == "qwen3_5" else dict(raw)
        num_layers = int(text["num_hidden_layers"])
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)]
        rope: dict[str, Any] = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        _require(rope_type == "default", f"rope_type {rope_type!r} is not supported (only 'default')")
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        required = {name: int(text[name]) for name in (
            "vocab_size", "intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim")}
        return cls(
            **required,
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads", heads)),
            head_dim=int(text.get("head_dim") or hidden // heads),
            layer_types=tuple(layer_types),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(tie),
            attention_bias=bool(text.get("attention_bias", False)),
            hidden_act=str(text.get("hidden_act", "silu")),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
        )


@dataclass(frozen=True)
class CacheConfig:
    """Sizes of the paged KV pool and the GDN snapshot pool (the joint prefix cache; how they are
    planned: docs/serving.md, Sizing), the block size and hash, and the snapshot policy."""

    block_size: int = 16
    kv_cache_mib: float | None = None
    prefix_cache_mib: float | None = None
    snapshot_interval: int = 256
    cache_policy: str = "hybridserve"
    kv_cache_memory_bytes: int | None = None
    memory_fraction: float | None = None
    snapshot_memory_share: float = 0.5
    block_hash: str = "xxh3_128"
    block_hash_seed: int | None = None  # keys xxh3_128 (see cache/block_pool.py `engine_block_hash`)
    # Lower tiers of the joint cache (hybridserve/cache/tier_store.py): 0 / None keep them off.
    host_cache_memory_bytes: int = 0
    disk_cache_dir: str | None = None
    disk_cache_size_bytes: int | None = None
    tier_write_policy: str = "write-through"
    remote_cache_url: str | None = None  # the shared remote tier (cache/remote_store.py): redis://HOST:PORT/DB

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _require(self.kv_cache_mib is None or self.kv_cache_mib > 0,
                 f"kv_cache_mib must be > 0, got {self.kv_cache_mib}")
        _require(self.prefix_cache_mib is None or self.prefix_cache_mib >= 0,
                 f"prefix_cache_mib must be >= 0, got {self.prefix_cache_mib}")
        _require(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
                 f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory_bytes}")
        _require(self.memory_fraction is None or 0.0 < self.memory_fraction <= 1.0,
                 f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        _require(0.0 <= self.snapshot_memory_share < 1.0,
                 f"snapshot_memory_share must be in [0, 1), got {self.snapshot_memory_share}")
        _require(self.block_hash in BLOCK_HASHES, f"block_hash must be one of {BLOCK_HASHES}, got {self.block_hash!r}")
        _require(self.block_hash_seed is None or 0 <= self.block_hash_seed < 1 << 64,
                 "block_hash_seed must be an unsigned 64-bit integer")
        _require(self.snapshot_interval >= 1 and self.snapshot_interval % self.block_size == 0,
                 f"snapshot_interval ({self.snapshot_interval}) must be a positive multiple of "
                 f"block_size ({self.block_size})")
        _require(self.cache_policy in POLICY_NAMES,
                 f"unknown cache policy {self.cache_policy!r}; choose one of {', '.join(POLICY_NAMES)}")
        self._check_tiers()

    def _check_tiers(self) -> None:
        _require(self.host_cache_memory_bytes >= 0,
                 f"host cache memory must be >= 0 bytes, got {self.host_cache_memory_bytes}")
        _require(self.tier_write_policy in TIER_WRITE_POLICIES,
                 f"tier write policy must be one of {', '.join(TIER_WRITE_POLICIES)}, got {self.tier_write_policy!r}")
        if self.remote_cache_url is not None:
            check_remote_cache_url(self.remote_cache_url)
        if self.disk_cache_dir is None:
            _require(self.disk_cache_size_bytes is None, "--disk-cache-size needs --disk-cache-dir")
            return
        _require(self.disk_cache_size_bytes is not None and self.disk_cache_size_bytes > 0,
                 "--disk-cache-dir needs --disk-cache-size (e.g. 64GiB)")
        check_disk_cache_dir(self.disk_cache_dir)

    @property
    def prefix_cache_enabled(self) -> bool:
        return self.prefix_cache_mib != 0


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_waiting_requests: int = 1024
    max_prefill_tokens_during_decode: int = 12  # 0: no cap (prefill may fill the whole step)

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.max_model_len is None or self.max_model_len >= 2,
                 f"max_model_len must be >= 2, got {self.max_model_len}")
        _require(self.max_waiting_requests >= 1, "max_waiting_requests must be >= 1")
        _require(self.max_prefill_tokens_during_decode >= 0, "max_prefill_tokens_during_decode must be >= 0")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, resolved: model path (None = built-in), device, dtype, pools."""

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    num_threads: int | None = None  # CPU threads for torch and the C kernels; None: every available core
    quantization: str | None = None  # "int8": weight-only int8 linears (see layers.linear)
    tensor_parallel_size: int = 1   # model ranks (worker processes when > 1); see hybridserve.distributed
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        _require(self.dtype in ("auto", "float32", "bfloat16", "float16"),
                 f"dtype must be one of auto/float32/bfloat16/float16, got {self.dtype!r}")
        _require(self.quantization in (None, "int8"),
                 f"quantization must be None or 'int8', got {self.quantization!r}")
        _require(self.num_threads is None or self.num_threads >= 1, f"num_threads must be >= 1, got {self.num_threads}")
        _require(isinstance(self.tensor_parallel_size, int) and not isinstance(self.tensor_parallel_size, bool)
                 and self.tensor_parallel_size >= 1,
                 f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")

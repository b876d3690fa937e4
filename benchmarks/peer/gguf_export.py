"""Write a hybridserve model (a Hugging Face Qwen3.5 dir, or the built-in model) as a GGUF file
that llama.cpp's `qwen35` architecture loads: the weights in f32, bf16 or q8_0 plus the
hyperparameters and the byte-level BPE tokenizer.

Written with the `gguf` package directly (`pip install gguf`, pure Python), not with llama.cpp's
`convert_hf_to_gguf.py`: that converter identifies the pre-tokenizer by hashing the encoding of a
fixed test text, and the built-in tokenizer's hash is in none of its tables. Here the
pre-tokenizer is named explicitly: `tokenizer.ggml.pre = "qwen35"`, llama.cpp's name for the
Qwen3.5 split regex, which is exactly the regex of `hybridserve.models.tokenizer` (llama.cpp does
not apply the NFC normalizer; the peer benchmark sends token ids, so text never matters).

Tensor layout follows llama.cpp's `qwen35` loader:
  * zero-centred RMSNorm weights (every `*norm.weight` except the GDN output norm) are stored as
    1 + w, since llama.cpp multiplies by the weight directly;
  * `A_log` is stored as `ssm_a = -exp(A_log)`, `dt_bias` as `ssm_dt.bias`, the depthwise conv
    kernel squeezed to [channels, kernel];
  * the GDN value heads are reordered from grouped by key head (Hugging Face: v head h reads key
    head h // r) to tiled (ggml broadcast: v head h reads key head h % Hk) in every tensor with a
    value-head axis (V rows of qkv and of the conv, z, a, b, A, dt, out_proj columns);
  * 1-D tensors, norms, the conv kernel, `ssm_a` and `ssm_dt.bias` stay float32 in every output
    type; the matrices (embedding and head included) take the output type.

Usage: `python -m benchmarks.peer.gguf_export OUT.gguf [--model DIR] [--outtype f32|bf16|q8_0]`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hybridserve.config import LINEAR_ATTENTION, ModelConfig
from hybridserve.models.tokenizer import Tokenizer

if TYPE_CHECKING:
    import gguf

ARCH = "qwen35"
PRE_TOKENIZER = "qwen35"
OUTTYPES = ("f32", "bf16", "q8_0")
# llama.cpp's qwen35 loader requires rope sections (interleaved M-RoPE); text tokens carry the
# same position in every section, so for text the values only need to be present.
ROPE_SECTIONS = (11, 11, 10, 0)
# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5

# Hugging Face per-layer suffix -> (gguf MODEL_TENSOR name, GGUF name suffix).
_LAYER_TENSORS = {
    "input_layernorm.weight": ("ATTN_NORM", ".weight"),
    "post_attention_layernorm.weight": ("ATTN_POST_NORM", ".weight"),
    "mlp.gate_proj.weight": ("FFN_GATE", ".weight"),
    "mlp.up_proj.weight": ("FFN_UP", ".weight"),
    "mlp.down_proj.weight": ("FFN_DOWN", ".weight"),
    "self_attn.q_proj.weight": ("ATTN_Q", ".weight"),
    "self_attn.k_proj.weight": ("ATTN_K", ".weight"),
    "self_attn.v_proj.weight": ("ATTN_V", ".weight"),
    "self_attn.o_proj.weight": ("ATTN_OUT", ".weight"),
    "self_attn.q_proj.bias": ("ATTN_Q", ".bias"),
    "self_attn.k_proj.bias": ("ATTN_K", ".bias"),
    "self_attn.v_proj.bias": ("ATTN_V", ".bias"),
    "self_attn.o_proj.bias": ("ATTN_OUT", ".bias"),
    "self_attn.q_norm.weight": ("ATTN_Q_NORM", ".weight"),
    "self_attn.k_norm.weight": ("ATTN_K_NORM", ".weight"),
    "linear_attn.in_proj_qkv.weight": ("ATTN_QKV", ".weight"),
    "linear_attn.in_proj_z.weight": ("ATTN_GATE", ".weight"),
    "linear_attn.in_proj_b.weight": ("SSM_BETA", ".weight"),
    "linear_attn.in_proj_a.weight": ("SSM_ALPHA", ".weight"),
    "linear_attn.conv1d.weight": ("SSM_CONV1D", ".weight"),
    "linear_attn.dt_bias": ("SSM_DT", ".bias"),
    "linear_attn.A_log": ("SSM_A", ""),
    "linear_attn.norm.weight": ("SSM_NORM", ".weight"),
    "linear_attn.out_proj.weight": ("SSM_OUT", ".weight"),
}
_GLOBAL_TENSORS = {
    "model.embed_tokens.weight": ("TOKEN_EMBD", ".weight"),
    "model.norm.weight": ("OUTPUT_NORM", ".weight"),
    "lm_head.weight": ("OUTPUT", ".weight"),
}
_KEEP_F32 = ("SSM_CONV1D", "SSM_A", "SSM_DT")


def require_gguf() -> Any:
    """The `gguf` module, or ImportError saying how to install it."""
    try:
        import gguf
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("writing GGUF needs the `gguf` package: pip install gguf "
                          "(or pip install -e '.[peer]')") from exc
    return gguf


# =========================================================================== tensors
def gguf_tensor_name(hf_name: str) -> tuple[str, str]:
    """(GGUF tensor name, gguf MODEL_TENSOR member name) of a Hugging Face text-decoder tensor."""
    gguf = require_gguf()
    if hf_name in _GLOBAL_TENSORS:
        kind, suffix = _GLOBAL_TENSORS[hf_name]
        return gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[kind]] + suffix, kind
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdecimal() and parts[3] in _LAYER_TENSORS:
        kind, suffix = _LAYER_TENSORS[parts[3]]
        return gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[kind]].format(bid=int(parts[2])) + suffix, kind
    raise ValueError(f"no GGUF name for tensor {hf_name!r}")


def grouped_to_tiled_heads(tensor: torch.Tensor, dim: int, num_k_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder the value heads along `dim` from grouped by key head (Hugging Face) to tiled
    (ggml broadcast): new head j * Hk + k is old head k * r + j, r = Hv / Hk."""
    dim = dim % tensor.dim()
    size = tensor.shape[dim]
    per_k = size // (num_k_heads * head_dim)
    split = (*tensor.shape[:dim], num_k_heads, per_k, head_dim, *tensor.shape[dim + 1:])
    return tensor.reshape(split).transpose(dim, dim + 1).reshape(tensor.shape).contiguous()


def convert_tensor(hf_name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """The float32 value llama.cpp expects for `hf_name` (see the module docstring)."""
    value = tensor.detach().to(torch.float32)
    if hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
        value = value + 1.0
    if hf_name.endswith("linear_attn.A_log"):
        value = -torch.exp(value)
    if hf_name.endswith("linear_attn.conv1d.weight"):
        value = value.squeeze(1)
    if ".linear_attn." in hf_name and config.linear_num_key_heads != config.linear_num_value_heads:
        value = _tile_value_heads(hf_name, value, config)
    return value.contiguous()


def _tile_value_heads(hf_name: str, value: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    hk, dv = config.linear_num_key_heads, config.linear_value_head_dim
    if hf_name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        key_rows = 2 * config.gdn_key_dim
        return torch.cat([value[:key_rows], grouped_to_tiled_heads(value[key_rows:], 0, hk, dv)])
    if hf_name.endswith("in_proj_z.weight"):
        return grouped_to_tiled_heads(value, 0, hk, dv)
    if hf_name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return grouped_to_tiled_heads(value, 0, hk, 1)
    if hf_name.endswith("out_proj.weight"):
        return grouped_to_tiled_heads(value, 1, hk, dv)
    return value


def storage_type(kind: str, gguf_name: str, shape: tuple[int, ...], outtype: str) -> gguf.GGMLQuantizationType:
    """The GGML type a tensor is stored in: float32 for 1-D tensors, norms, the conv kernel,
    `ssm_a` and biases; `outtype` for the matrices."""
    gguf = require_gguf()
    q = gguf.GGMLQuantizationType
    if len(shape) <= 1 or kind in _KEEP_F32 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight"):
        return q.F32
    return {"f32": q.F32, "bf16": q.BF16, "q8_0": q.Q8_0}[outtype]


def _encode(value: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    gguf = require_gguf()
    data = value.numpy()
    if qtype == gguf.GGMLQuantizationType.F32:
        return data
    return gguf.quants.quantize(data, qtype)


# =========================================================================== sources
def iter_checkpoint_tensors(model_dir: str | Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face text-decoder name, tensor) of every loaded tensor of a model dir, in file
    order (vision tower, MTP head and a tied `lm_head` are skipped, as the loader does)."""
    from safetensors import safe_open

    from hybridserve.models.loader import checkpoint_files, checkpoint_name_to_model_name

    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt") as handle:
            for source in handle.keys():
                name = checkpoint_name_to_model_name(source, config)
                if name is not None:
                    yield name, handle.get_tensor(source)


# =========================================================================== metadata
def add_hparams(writer: gguf.GGUFWriter, config: ModelConfig, name: str) -> None:
    """The `qwen35` hyperparameters llama.cpp reads."""
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_rope_dimension_count(config.rotary_dim)
    writer.add_rope_dimension_sections(list(ROPE_SECTIONS))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_num_key_heads)
    writer.add_ssm_time_step_rank(config.linear_num_value_heads)
    writer.add_ssm_inner_size(config.gdn_value_dim)
    interval = _attention_interval(config)
    if interval is not None:
        writer.add_full_attention_interval(interval)
    writer.add_array(f"{ARCH}.attention.recurrent_layers", [t == LINEAR_ATTENTION for t in config.layer_types])


def _attention_interval(config: ModelConfig) -> int | None:
    """N when every N-th layer (and only those) is full attention, else None."""
    attention = config.attention_layer_ids
    if not attention:
        return None
    interval = attention[0] + 1
    expected = tuple(i for i in range(config.num_hidden_layers) if (i + 1) % interval == 0)
    return interval if attention == expected else None


def add_tokenizer(writer: gguf.GGUFWriter, tokenizer: Tokenizer, config: ModelConfig) -> None:
    """The byte-level BPE vocabulary ("gpt2" model, pre-tokenizer named explicitly), merges,
    special ids and chat template. Ids the model has beyond the tokenizer are `[PADn]` unused."""
    backend = tokenizer.backend
    added = backend.get_added_tokens_decoder()
    tokens: list[str] = []
    types: list[int] = []
    for token_id in range(config.vocab_size):
        text = backend.id_to_token(token_id)
        if text is None:
            tokens.append(f"[PAD{token_id}]")
            types.append(TOKEN_UNUSED)
        elif token_id in added:
            tokens.append(text)
            types.append(TOKEN_CONTROL if added[token_id].special else TOKEN_USER_DEFINED)
        else:
            tokens.append(text)
            types.append(TOKEN_NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(bpe_merges(tokenizer))
    eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
    if eos is not None:
        writer.add_eos_token_id(eos)
    pad = backend.token_to_id("<|endoftext|>")
    if pad is not None:
        writer.add_pad_token_id(pad)
    if config.bos_token_id is not None:
        writer.add_bos_token_id(config.bos_token_id)
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def bpe_merges(tokenizer: Tokenizer) -> list[str]:
    """The BPE merges of a tokenizer as "left right" strings, in merge order."""
    model = json.loads(tokenizer.backend.to_str())["model"]
    return [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in model.get("merges", [])]


# =========================================================================== writer
def write_gguf(out_path: str | Path, config: ModelConfig, tensors: Iterator[tuple[str, torch.Tensor]],
               tokenizer: Tokenizer, outtype: str = "f32", name: str = "hybridserve") -> Path:
    """Write `tensors` (Hugging Face names, any float dtype) of a model of `config` with
    `tokenizer` as a `qwen35` GGUF file of `outtype` (f32, bf16 or q8_0)."""
    gguf = require_gguf()
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {OUTTYPES}, got {outtype!r}")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), ARCH)
    add_hparams(writer, config, name)
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
    writer.add_file_type(int(file_type))
    add_tokenizer(writer, tokenizer, config)
    for hf_name, tensor in tensors:
        gguf_name, kind = gguf_tensor_name(hf_name)
        value = convert_tensor(hf_name, tensor, config)
        qtype = storage_type(kind, gguf_name, tuple(value.shape), outtype)
        writer.add_tensor(gguf_name, _encode(value, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def export_model_dir(model_dir: str | Path, out_path: str | Path, outtype: str = "f32") -> Path:
    """Write the Hugging Face Qwen3.5 model dir `model_dir` (config, safetensors, tokenizer) as GGUF."""
    from hybridserve.models.loader import read_model_config

    config = read_model_config(model_dir)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    return write_gguf(out_path, config, iter_checkpoint_tensors(model_dir, config), tokenizer, outtype,
                      name=Path(model_dir).resolve().name)


def export_builtin(out_path: str | Path, outtype: str = "f32", seed: int = 0) -> Path:
    """Write the built-in model (weights of `seed`, the ones `hybridserve serve` uses) as GGUF."""
    from hybridserve.models.builtin import BUILTIN_MODEL_CONFIG, builtin_state_dict, builtin_tokenizer

    tensors = iter(builtin_state_dict(seed=seed).items())
    return write_gguf(out_path, BUILTIN_MODEL_CONFIG, tensors, builtin_tokenizer(), outtype,
                      name="hybridserve-builtin")


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.peer.gguf_export OUT.gguf [--model DIR] [--outtype f32|bf16|q8_0]`."""
    parser = argparse.ArgumentParser(description="write a hybridserve model as a llama.cpp qwen35 GGUF file")
    parser.add_argument("out", help="GGUF file to write")
    parser.add_argument("--model", default=None, help="Hugging Face model dir (the built-in model when omitted)")
    parser.add_argument("--outtype", default="f32", choices=OUTTYPES, help="type of the weight matrices")
    args = parser.parse_args(argv)
    path = (export_model_dir(args.model, args.out, args.outtype) if args.model
            else export_builtin(args.out, args.outtype))
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {args.outtype})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The GGUF writer of the peer benchmark, read back with `gguf.GGUFReader` (no llama.cpp needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hybridserve.models.loader import read_model_config
from hybridserve.models.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf", reason="the GGUF writer needs the `gguf` package (pip install gguf)")

from benchmarks.peer.gguf_export import (  # noqa: E402 - after the importorskip
    bpe_merges,
    export_model_dir,
    grouped_to_tiled_heads,
)

Q = gguf.GGMLQuantizationType


def _fields(reader: gguf.GGUFReader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items()}


def _tensors(reader: gguf.GGUFReader) -> dict:
    return {t.name: t for t in reader.tensors}


@pytest.fixture(scope="module")
def f32_gguf(text_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_model_dir(text_checkpoint, tmp_path_factory.mktemp("gguf") / "model-f32.gguf", "f32")


def test_grouped_to_tiled_heads_order() -> None:
    # 2 key heads, 3 value heads each, head dim 1: grouped [k0v0 k0v1 k0v2 k1v0 k1v1 k1v2] -> tiled.
    grouped = torch.tensor([0, 1, 2, 10, 11, 12])
    assert grouped_to_tiled_heads(grouped, 0, 2, 1).tolist() == [0, 10, 1, 11, 2, 12]
    rows = torch.arange(12).reshape(6, 2)  # head dim 2 along dim 1 of a [1, 12] matrix
    tiled = grouped_to_tiled_heads(rows.reshape(1, 12), 1, 2, 2)
    assert tiled.reshape(6, 2)[:, 0].tolist() == [0, 6, 2, 8, 4, 10]


def test_metadata_and_tokenizer(f32_gguf: Path, text_checkpoint: Path) -> None:
    config = read_model_config(text_checkpoint)
    tokenizer = Tokenizer.from_model_dir(text_checkpoint)
    fields = _fields(gguf.GGUFReader(f32_gguf))
    assert fields["general.architecture"] == "qwen35"
    assert fields["qwen35.block_count"] == config.num_hidden_layers
    assert fields["qwen35.embedding_length"] == config.hidden_size
    assert fields["qwen35.attention.head_count_kv"] == config.num_key_value_heads
    assert fields["qwen35.rope.dimension_count"] == config.rotary_dim
    assert fields["qwen35.ssm.group_count"] == config.linear_num_key_heads
    assert fields["qwen35.ssm.time_step_rank"] == config.linear_num_value_heads
    assert fields["qwen35.attention.recurrent_layers"] == [t == "linear_attention" for t in config.layer_types]
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.pre"] == "qwen35"
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == config.vocab_size
    assert all(tokens[i] == tokenizer.backend.id_to_token(i) for i in range(tokenizer.vocab_size))
    types = fields["tokenizer.ggml.token_type"]
    assert types[tokenizer.token_to_id("<|im_end|>")] == 3 and types[300] == 1
    assert fields["tokenizer.ggml.merges"] == bpe_merges(tokenizer)
    assert fields["tokenizer.ggml.eos_token_id"] in tokenizer.eos_token_ids
    assert fields["tokenizer.ggml.add_bos_token"] is False


def test_tensor_values_follow_the_llama_cpp_layout(f32_gguf: Path, text_checkpoint: Path) -> None:
    config = read_model_config(text_checkpoint)
    hf = load_file(str(text_checkpoint / "model.safetensors"))
    tensors = _tensors(gguf.GGUFReader(f32_gguf))
    expected = 3 + sum(14 if t == "linear_attention" else 11 for t in config.layer_types)  # embd, norm, head
    assert len(tensors) == expected
    assert all(t.tensor_type == Q.F32 for t in tensors.values())

    def value(name: str) -> np.ndarray:
        t = tensors[name]
        return np.asarray(t.data).reshape([int(n) for n in reversed(t.shape)])

    np.testing.assert_array_equal(value("token_embd.weight"), hf["model.embed_tokens.weight"].numpy())
    np.testing.assert_allclose(value("blk.0.attn_norm.weight"),
                               1.0 + hf["model.layers.0.input_layernorm.weight"].numpy())
    np.testing.assert_array_equal(value("blk.0.ssm_norm.weight"), hf["model.layers.0.linear_attn.norm.weight"].numpy())
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    a_log = hf["model.layers.0.linear_attn.A_log"]
    tiled = a_log.reshape(hk, hv // hk).T.reshape(-1)
    np.testing.assert_allclose(value("blk.0.ssm_a"), -torch.exp(tiled).numpy(), rtol=1e-6)
    conv = tensors["blk.0.ssm_conv1d.weight"]
    assert [int(n) for n in conv.shape] == [config.linear_conv_kernel_dim, config.gdn_conv_dim]
    key_rows = 2 * config.gdn_key_dim
    qkv = value("blk.0.attn_qkv.weight")
    np.testing.assert_array_equal(qkv[:key_rows],
                                  hf["model.layers.0.linear_attn.in_proj_qkv.weight"][:key_rows].numpy())
    q_proj = tensors["blk.3.attn_q.weight"]
    assert [int(n) for n in q_proj.shape] == [config.hidden_size, 2 * config.num_attention_heads * config.head_dim]


@pytest.mark.parametrize("outtype,matrix_type", [("bf16", Q.BF16), ("q8_0", Q.Q8_0)])
def test_reduced_types_keep_vectors_float32(outtype: str, matrix_type: gguf.GGMLQuantizationType,
                                            f32_gguf: Path, text_checkpoint: Path, tmp_path: Path) -> None:
    path = export_model_dir(text_checkpoint, tmp_path / f"model-{outtype}.gguf", outtype)
    tensors = _tensors(gguf.GGUFReader(path))
    reference = _tensors(gguf.GGUFReader(f32_gguf))
    for name, tensor in tensors.items():
        vector = len(tensor.shape) == 1 or "norm" in name or "ssm_conv1d" in name
        assert tensor.tensor_type == (Q.F32 if vector else matrix_type), name
    down = tensors["blk.0.ffn_down.weight"]
    restored = gguf.quants.dequantize(down.data, down.tensor_type).reshape(-1)
    exact = np.asarray(reference["blk.0.ffn_down.weight"].data).reshape(-1)
    assert np.max(np.abs(restored - exact)) <= 0.01 * np.max(np.abs(exact))

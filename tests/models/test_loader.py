"""Tests of the checkpoint loader, the tokenizer and the built-in model pieces.

The target module is transformers' `Qwen3_5ForCausalLM`, whose parameter names are the ones
hybridserve's model uses, so these tests do not need hybridserve's model class.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hybridserve.config import ModelConfig
from hybridserve.models import loader
from hybridserve.models.builtin import (
    BUILTIN_MODEL_CONFIG,
    builtin_state_dict,
    builtin_tokenizer,
    hf_config_dict,
    init_builtin_weights,
    parameter_shapes,
    save_builtin_checkpoint,
)
from hybridserve.models.loader import load_weights, read_model_config
from hybridserve.models.tokenizer import ENDOFTEXT_ID, IM_END_ID, IM_START_ID, Tokenizer
from tests.helpers.checkpoints import (
    FAKE_MTP_TENSORS,
    fresh_text_model,
    reference_text_model,
    rewrite_tensors,
    text_config,
)


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / src.name))


def _assert_same_params(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    ref = dict(reference.named_parameters())
    names = [name for name, _ in model.named_parameters()]
    assert names == list(ref)
    for name, param in model.named_parameters():
        assert torch.equal(param, ref[name]), name


def _load_fresh(path: Path) -> torch.nn.Module:
    model = fresh_text_model(path)
    load_weights(model, path, read_model_config(path), show_progress=False)
    return model


# -- config -------------------------------------------------------------------------------


def test_read_model_config_text(text_checkpoint: Path) -> None:
    config = read_model_config(text_checkpoint)
    assert config.hidden_size == 64 and config.num_hidden_layers == 4 and config.vocab_size == 4096
    assert config.layer_types[3] == "full_attention" and config.gdn_layer_ids == (0, 1, 2)
    assert config.eos_token_ids == (ENDOFTEXT_ID, IM_END_ID) and not config.tie_word_embeddings


def test_read_model_config_multimodal(multimodal_checkpoint: Path, text_checkpoint: Path) -> None:
    mm = read_model_config(multimodal_checkpoint)
    assert mm == read_model_config(text_checkpoint)


@pytest.mark.parametrize("content", [None, "{not json", "[1, 2]"])
def test_read_model_config_errors(tmp_path: Path, content: str | None) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        read_model_config(tmp_path / "nope")
    if content is None:
        with pytest.raises(ValueError, match="no config.json"):
            read_model_config(tmp_path)
    else:
        (tmp_path / "config.json").write_text(content)
        with pytest.raises(ValueError, match="config.json"):
            read_model_config(tmp_path)


# -- loading ------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["text_checkpoint", "tied_text_checkpoint", "sharded_checkpoint",
                                     "multimodal_checkpoint"])
def test_load_matches_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    model = _load_fresh(path)
    _assert_same_params(model, reference_text_model(path))


def test_load_matches_file_tensors(text_checkpoint: Path) -> None:
    model = _load_fresh(text_checkpoint)
    params = dict(model.named_parameters())
    with safe_open(str(text_checkpoint / "model.safetensors"), framework="pt") as handle:
        assert set(handle.keys()) == set(params)
        for name in handle.keys():
            assert torch.equal(params[name], handle.get_tensor(name)), name


def test_sharded_layout(sharded_checkpoint: Path) -> None:
    assert (sharded_checkpoint / loader.INDEX_FILE).is_file()
    assert len(loader.checkpoint_files(sharded_checkpoint)) > 1


def test_multimodal_layout_is_mapped(multimodal_checkpoint: Path) -> None:
    with safe_open(str(multimodal_checkpoint / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
    assert "model.language_model.embed_tokens.weight" in keys and "lm_head.weight" in keys
    assert any(k.startswith("model.visual.") for k in keys)
    assert set(FAKE_MTP_TENSORS) <= keys
    assert not any(k.startswith("model.layers.") for k in keys)
    config = read_model_config(multimodal_checkpoint)
    assert loader.checkpoint_name_to_model_name("model.language_model.norm.weight", config) == "model.norm.weight"
    assert loader.checkpoint_name_to_model_name("mtp.fc.weight", config) is None
    assert loader.checkpoint_name_to_model_name("model.visual.blocks.0.attn.qkv.weight", config) is None


def test_tied_lm_head_in_file_is_ignored(tied_text_checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(tied_text_checkpoint, tmp_path)
    rewrite_tensors(path / "model.safetensors", add={"lm_head.weight": torch.full((4096, 64), 7.0)})
    model = _load_fresh(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not torch.equal(model.lm_head.weight, torch.full((4096, 64), 7.0))
    _assert_same_params(model, reference_text_model(tied_text_checkpoint))


def test_load_converts_dtype(text_checkpoint: Path) -> None:
    model = fresh_text_model(text_checkpoint).to(torch.bfloat16)
    load_weights(model, text_checkpoint, read_model_config(text_checkpoint), show_progress=False)
    reference = reference_text_model(text_checkpoint)
    ref = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert param.dtype == torch.bfloat16
        assert torch.equal(param, ref[name].to(torch.bfloat16)), name


@pytest.mark.parametrize(("drop", "add", "pattern"), [
    (("model.layers.1.linear_attn.A_log",), None, r"missing tensors \(1\): model\.layers\.1\.linear_attn\.A_log"),
    ((), {"model.layers.0.mlp.extra.weight": torch.zeros(2)}, r"unexpected tensors.*model\.layers\.0\.mlp\.extra"),
    (("model.norm.weight",), {"model.norm.weight": torch.zeros(65)},
     r"model\.norm\.weight: checkpoint \[65\], model \[64\]"),
    ((), {"model.language_model.norm.weight": torch.zeros(64)}, r"duplicated tensors.*model\.norm\.weight"),
])
def test_mismatched_checkpoint_raises(text_checkpoint: Path, tmp_path: Path, drop: tuple[str, ...],
                                      add: dict[str, torch.Tensor] | None, pattern: str) -> None:
    path = _copy(text_checkpoint, tmp_path)
    rewrite_tensors(path / "model.safetensors", drop=drop, add=add)
    model = fresh_text_model(path)
    with pytest.raises(ValueError, match=pattern):
        load_weights(model, path, read_model_config(path), show_progress=False)
    assert all(torch.isnan(p).all() for p in model.parameters()), "nothing is copied on error"


def test_untied_model_requires_lm_head(multimodal_checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(multimodal_checkpoint, tmp_path)
    rewrite_tensors(path / "model.safetensors", drop=("lm_head.weight",))
    with pytest.raises(ValueError, match=r"missing tensors \(1\): lm_head\.weight"):
        load_weights(fresh_text_model(path), path, read_model_config(path), show_progress=False)


def test_missing_weights_raise(text_checkpoint: Path, sharded_checkpoint: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        loader.checkpoint_files(empty)
    with pytest.raises(ValueError, match="does not exist"):
        load_weights(torch.nn.Linear(1, 1), tmp_path / "absent", read_model_config(text_checkpoint))
    sharded = _copy(sharded_checkpoint, tmp_path)
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ValueError, match="model-00002"):
        loader.checkpoint_files(sharded)


def test_progress_bar_only_for_large_checkpoints(text_checkpoint: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    config = read_model_config(text_checkpoint)
    load_weights(fresh_text_model(text_checkpoint), text_checkpoint, config)
    assert "loading weights" not in capsys.readouterr().err
    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", 0)
    load_weights(fresh_text_model(text_checkpoint), text_checkpoint, config)
    assert "loading weights" in capsys.readouterr().err
    load_weights(fresh_text_model(text_checkpoint), text_checkpoint, config, show_progress=False)
    assert "loading weights" not in capsys.readouterr().err


# -- tokenizer ----------------------------------------------------------------------------


TEXTS = ["Hello, world!", "The joint prefix cache — ünïcödé 日本語 12345\n\n\ttabs  and  spaces ",
         "<|im_start|>user\nhi<|im_end|>\n", ""]


def test_tokenizer_from_model_dir_round_trips(text_checkpoint: Path) -> None:
    tok = Tokenizer.from_model_dir(text_checkpoint)
    for text in TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.encode("<|im_start|>") == [IM_START_ID]
    assert tok.decode(tok.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"
    assert tok.vocab_size == 4096
    assert {ENDOFTEXT_ID, IM_START_ID, IM_END_ID} <= tok.special_token_ids
    assert tok.eos_token_ids == (IM_END_ID, ENDOFTEXT_ID)  # tokenizer_config, then generation_config
    assert tok.chat_template is not None


def test_tokenizer_decodes_every_id(builtin_tok: Tokenizer) -> None:
    every = list(range(builtin_tok.vocab_size))
    assert isinstance(builtin_tok.decode(every), str)
    assert isinstance(builtin_tok.decode(every, skip_special_tokens=False), str)
    for i in range(0, builtin_tok.vocab_size, 7):
        builtin_tok.decode([i], skip_special_tokens=False)
    assert builtin_tok.decode([72, 5000, -1, 105]) == "Hi"  # out-of-vocab ids are dropped


def test_builtin_vocabulary_is_visible_text(builtin_tok: Tokenizer) -> None:
    """Apart from the specials and single bytes, every built-in id decodes to printable text."""
    from hybridserve.models.builtin import rare_token_ids

    rare = set(rare_token_ids())
    visible = [i for i in range(builtin_tok.vocab_size) if i not in rare]
    assert len(visible) == builtin_tok.vocab_size - len(rare) > 3900
    for token_id in visible:
        text = builtin_tok.decode([token_id])
        assert text and all(c.isprintable() or c in "\n\t" for c in text), (token_id, text)


def test_tokenizer_eos_merge_and_errors(builtin_tok: Tokenizer, tmp_path: Path) -> None:
    merged = builtin_tok.with_extra_eos_token_ids([7, ENDOFTEXT_ID, 9])
    assert merged.eos_token_ids == (ENDOFTEXT_ID, IM_END_ID, 7, 9)
    assert builtin_tok.eos_token_ids == (ENDOFTEXT_ID, IM_END_ID)
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_model_dir(tmp_path)


def test_tokenizer_config_variants(builtin_tok: Tokenizer, tmp_path: Path) -> None:
    builtin_tok.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(eos_token={"content": "<|endoftext|>"}, chat_template=None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}|{{ eos_token }}")
    tok = Tokenizer.from_model_dir(tmp_path)
    assert tok.eos_token_ids == (ENDOFTEXT_ID,)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x|<|endoftext|>"


def test_builtin_tokenizer_layout_and_determinism(builtin_tok: Tokenizer) -> None:
    again = builtin_tokenizer()
    assert again is not builtin_tok  # a fresh instance each call, built the same way every time
    assert again.backend.to_str() == builtin_tok.backend.to_str()
    assert builtin_tok.vocab_size == 4096 == BUILTIN_MODEL_CONFIG.vocab_size
    assert builtin_tok.backend.id_to_token(4095) is not None and builtin_tok.backend.id_to_token(4096) is None
    assert [builtin_tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [256, 257, 258]
    assert set(BUILTIN_MODEL_CONFIG.eos_token_ids) == {builtin_tok.token_to_id("<|endoftext|>"),
                                                       builtin_tok.token_to_id("<|im_end|>")}
    assert len(builtin_tok.encode("the key value cache")) < len("the key value cache") / 2, "merges learned"
    # Rust hash seeds differ between processes: the tokenizer must not depend on them.
    code = "from hybridserve.models.tokenizer import Tokenizer as T; print(hash(T.byte_level(4096).backend.to_str()))"
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "0", "PYTHONPATH": str(Path(__file__).parents[2])}).stdout
            for _ in range(2)}
    assert len(runs) == 1


def test_chat_template_renders(builtin_tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = builtin_tok.apply_chat_template(messages)
    chatml = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert prompt == chatml + "<think>\n"  # Qwen3.5 layout: the generation prompt opens a thinking block
    assert builtin_tok.apply_chat_template(messages, enable_thinking=False) == chatml + "<think>\n\n</think>\n\n"
    assert builtin_tok.apply_chat_template(messages, add_generation_prompt=False).endswith("Hi<|im_end|>\n")
    assert builtin_tok.encode(prompt).count(IM_START_ID) == 3


# -- built-in model -----------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{}, {"tie": True}, {"layers": 8, "full_attention_interval": 2}])
def test_parameter_shapes_match_transformers(overrides: dict[str, object]) -> None:
    from transformers import Qwen3_5ForCausalLM

    hf_config = text_config(**overrides)
    hf_config.attention_bias = bool(overrides)
    model = Qwen3_5ForCausalLM(hf_config)
    config = ModelConfig.from_hf_dict(hf_config.to_dict())
    assert parameter_shapes(config) == {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_builtin_config_layout() -> None:
    assert BUILTIN_MODEL_CONFIG.attention_layer_ids == (3, 7)
    assert ModelConfig.from_hf_dict(hf_config_dict(BUILTIN_MODEL_CONFIG)) == BUILTIN_MODEL_CONFIG


def test_builtin_checkpoint_loads_in_transformers_and_generates(tmp_path: Path) -> None:
    from transformers import Qwen3_5ForCausalLM

    path = save_builtin_checkpoint(tmp_path / "builtin")
    assert read_model_config(path) == BUILTIN_MODEL_CONFIG
    reference = reference_text_model(path)
    assert isinstance(reference, Qwen3_5ForCausalLM)
    state = builtin_state_dict()
    assert all(torch.equal(p, state[n]) for n, p in reference.named_parameters())

    ours = fresh_text_model(path)
    init_builtin_weights(ours)
    _assert_same_params(ours, reference)
    loaded = _load_fresh(path)
    _assert_same_params(loaded, reference)

    tok = Tokenizer.from_model_dir(path)
    for prompt in ("The joint prefix cache", "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            out = reference.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        generated = out[0, ids.shape[1]:].tolist()
        assert len(set(generated)) >= 12, generated
        assert tok.decode(generated).strip(), "random text should be visible, not only reserved tokens"

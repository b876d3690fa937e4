"""Shared pytest fixtures (session-scoped tiny checkpoints and the built-in tokenizer)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is first imported, and transformers may import it (through
# flash-linear-attention) before tests/kernels/test_triton_gdn.py runs: without a GPU, every Triton
# kernel of the session runs on the interpreter. gpu_check.sh sets 0 to compile them on a GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridserve.models.builtin import builtin_tokenizer
from hybridserve.models.tokenizer import Tokenizer
from tests.helpers.checkpoints import make_multimodal_checkpoint, make_text_checkpoint


@pytest.fixture(scope="session")
def text_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny untied text-only Qwen3.5 checkpoint (single model.safetensors)."""
    return make_text_checkpoint(tmp_path_factory.mktemp("text_ckpt"))


@pytest.fixture(scope="session")
def tied_text_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny text-only checkpoint with tied embeddings (no lm_head.weight in the file)."""
    return make_text_checkpoint(tmp_path_factory.mktemp("tied_ckpt"), tie=True, seed=1)


@pytest.fixture(scope="session")
def sharded_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny text-only checkpoint split into shards with model.safetensors.index.json."""
    return make_text_checkpoint(tmp_path_factory.mktemp("sharded_ckpt"), seed=2, max_shard_size="100KB")


@pytest.fixture(scope="session")
def multimodal_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny multimodal Qwen3.5 checkpoint (language_model + visual + fake mtp tensors)."""
    return make_multimodal_checkpoint(tmp_path_factory.mktemp("mm_ckpt"), seed=3)


@pytest.fixture(scope="session")
def builtin_tok() -> Tokenizer:
    """The built-in byte-level tokenizer."""
    return builtin_tokenizer()

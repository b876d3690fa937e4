"""Read a Hugging Face Qwen3.5 model directory: `config.json` and `*.safetensors` weights.

Text-only (`Qwen3_5ForCausalLM`) and multimodal (`Qwen3_5ForConditionalGeneration`:
`model.language_model.*`, `model.visual.*`, `mtp.*`) layouts load their text decoder; every tensor's
name and shape is checked before anything is copied.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from hybridserve.config import ModelConfig
from hybridserve.distributed.sharding import ShardSpec, local_shape, read_shard, shard_spec
from hybridserve.models.tokenizer import read_json_object

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PROGRESS_MIN_BYTES = 256 * 1024 * 1024
_IGNORED_PREFIXES = ("mtp.", "model.visual.", "visual.")
_MULTIMODAL_TEXT_PREFIX = "model.language_model."
_MAX_NAMES_IN_ERROR = 20
# a Hub repository id: an optional owner, then a name (letters, digits, '-', '_', '.')
_HUB_ID = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*")
# the files of a Hub snapshot the engine reads (config, weights and their index, tokenizer, chat template)
HUB_FILE_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model")


@dataclass(frozen=True)
class _Entry:
    """One checkpoint tensor that maps to a model tensor."""

    file: Path
    source: str
    target: str
    shape: tuple[int, ...] = ()      # full checkpoint shape
    spec: ShardSpec | None = None    # this rank's part (None: the whole tensor)


def read_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse `config.json` of a model dir (model_type `qwen3_5_text` or `qwen3_5`)."""
    config_file = _model_dir(model_dir) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"no config.json in model directory {str(config_file.parent)!r}")
    return ModelConfig.from_hf_dict(read_json_object(config_file))


def _model_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"model directory {str(path)!r} does not exist")
    return path


def is_hub_id(model: str) -> bool:
    """Whether `model` is spelled like a Hugging Face Hub repository id (`org/name` or `name`), as
    opposed to a filesystem path (absolute, `./`, `~`, or more than one separator)."""
    return bool(_HUB_ID.fullmatch(model)) and ".." not in model


def resolve_model(model: str) -> str:
    """The local directory of `model`: itself when it is a directory; for a Hub id (`org/name`), the
    snapshot `huggingface_hub` downloads into (or, offline with `HF_HUB_OFFLINE=1`, finds in) its
    cache. Raises a one-line `ValueError` naming the local-directory alternative otherwise."""
    path = Path(model).expanduser()
    if path.is_dir() or not is_hub_id(model):
        return str(_model_dir(path))
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled
    except ImportError:  # pragma: no cover - a dependency of tokenizers, so normally present
        raise ValueError(f"model {model!r} is not a local directory and huggingface_hub is not installed; "
                         "pass a model directory (Hugging Face layout)") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}  # read now
    try:
        return str(snapshot_download(model, allow_patterns=list(HUB_FILE_PATTERNS), local_files_only=offline))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, HfHubHTTPError, OSError, ValueError) as error:
        if offline:
            where = "in the local Hugging Face cache (HF_HUB_OFFLINE is set: nothing is downloaded)"
        else:
            detail = str(error).strip().splitlines()
            where = f"on the Hugging Face Hub ({detail[0] if detail else type(error).__name__})"
        raise ValueError(f"model {model!r} is not a local directory and could not be found {where}; "
                         f"download it where the Hub is reachable (`hf download {model} --local-dir DIR`) "
                         "and pass --model DIR") from None


def load_weights(
    model: torch.nn.Module, model_dir: str | Path, config: ModelConfig, *, show_progress: bool = True,
    rank: int = 0, world_size: int = 1,
) -> None:
    """Copy the checkpoint tensors of `model_dir` into `model` (in each target's dtype and device);
    `ValueError` names every missing, unexpected, duplicated or mis-shaped tensor before anything is
    copied. With `world_size > 1` only rank `rank`'s shard of each tensor is read."""
    files = checkpoint_files(model_dir)
    targets = _load_targets(model)
    entries = _plan(files, targets, config, rank, world_size)
    total_bytes = sum(f.stat().st_size for f in files)
    progress = tqdm(total=len(entries), desc="loading weights", unit="tensor",
                    disable=not show_progress or total_bytes <= PROGRESS_MIN_BYTES)
    with torch.no_grad(), progress:
        for file in files:
            data_start, header = _safetensors_header(file)
            with safe_open(str(file), framework="pt") as handle, file.open("rb", buffering=0) as stream:
                for entry in (e for e in entries if e.file == file):
                    if entry.spec is None:
                        _read_into(stream, data_start, header[entry.source], targets[entry.target])
                    else:
                        part = read_shard(handle.get_slice(entry.source), entry.shape, entry.spec)
                        targets[entry.target].copy_(part)
                    progress.update(1)


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def _safetensors_header(file: Path) -> tuple[int, dict[str, Any]]:
    """Where a safetensors file's data starts, and its header (name -> dtype, shape, data offsets)."""
    with file.open("rb") as stream:
        size = int.from_bytes(stream.read(8), "little")
        header = json.loads(stream.read(size))
    if not isinstance(header, dict):
        raise ValueError(f"{file}: the safetensors header is not an object")
    return 8 + size, header


def _read_into(stream: io.FileIO, data_start: int, info: dict[str, Any], target: torch.Tensor) -> None:
    """Read one whole tensor's bytes from the file with plain reads (no mapping, so the file's pages
    never count towards the process's memory), straight into `target` when it is a contiguous CPU
    tensor of the file's dtype, else through one temporary of that tensor's size."""
    begin, end = info["data_offsets"]
    dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
    if dtype is None or sys.byteorder != "little":
        raise ValueError(f"cannot read tensor dtype {info['dtype']!r} on this machine")
    direct = target.dtype == dtype and target.device.type == "cpu" and target.is_contiguous()
    buffer = target if direct else torch.empty(end - begin, dtype=torch.uint8)
    if buffer.numel() * buffer.element_size() != end - begin:
        raise ValueError(f"tensor of {end - begin} bytes does not fit its target of shape {tuple(target.shape)}")
    stream.seek(data_start + begin)
    view = (ctypes.c_char * (end - begin)).from_address(buffer.data_ptr())
    if end > begin and stream.readinto(view) != end - begin:
        raise ValueError("the safetensors file is truncated")
    if not direct:
        target.copy_(buffer.view(dtype).reshape(info["shape"]))


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model dir: the shards of the index, `model.safetensors`,
    or else every `*.safetensors` file (sorted)."""
    path = _model_dir(model_dir)
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"cannot read the weight map of {index}: no weight_map object")
        files = [path / name for name in sorted(set(weight_map.values()))]
    elif (path / SINGLE_FILE).is_file():
        files = [path / SINGLE_FILE]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {str(path)!r}")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"checkpoint shards listed in {INDEX_FILE} are missing: {missing}")
    return files


def checkpoint_name_to_model_name(name: str, config: ModelConfig) -> str | None:
    """Model parameter name of a checkpoint tensor, or None if the tensor is not loaded
    (vision tower, multi-token-prediction head, `lm_head` of a tied model)."""
    if name.startswith(_IGNORED_PREFIXES):
        return None
    if name.startswith(_MULTIMODAL_TEXT_PREFIX):
        name = "model." + name[len(_MULTIMODAL_TEXT_PREFIX):]
    return None if config.tie_word_embeddings and name == "lm_head.weight" else name


def _load_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (shared ones once) and persistent buffers of `model`, by name."""
    targets: dict[str, torch.Tensor] = dict(model.named_parameters())
    persistent = model.state_dict(keep_vars=True).keys()
    targets.update({n: b for n, b in model.named_buffers() if n in persistent and n not in targets})
    return targets


def _plan(files: list[Path], targets: dict[str, torch.Tensor], config: ModelConfig, rank: int = 0,
          world_size: int = 1) -> list[_Entry]:
    """Map every checkpoint tensor to a model tensor, checking names and shapes."""
    entries: dict[str, _Entry] = {}
    unexpected: list[str] = []
    duplicated: list[str] = []
    mis_shaped: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for source in handle.keys():
                target = checkpoint_name_to_model_name(source, config)
                if target is None:
                    continue
                if target not in targets:
                    unexpected.append(source)
                    continue
                if target in entries:
                    duplicated.append(f"{source} (and {entries[target].source})")
                    continue
                shape = tuple(handle.get_slice(source).get_shape())
                spec = shard_spec(target, config, rank, world_size)
                if local_shape(shape, spec) != tuple(targets[target].shape):
                    mis_shaped.append(f"{source}: checkpoint {list(shape)}, model {list(targets[target].shape)}"
                                      + (f" (rank {rank} of {world_size})" if world_size > 1 else ""))
                entries[target] = _Entry(file, source, target, shape, spec)
    missing = [name for name in targets if name not in entries]
    problems = [
        f"{label} ({len(names)}): {', '.join(names[:_MAX_NAMES_IN_ERROR])}"
        + (", ..." if len(names) > _MAX_NAMES_IN_ERROR else "")
        for label, names in (("missing tensors", missing), ("unexpected tensors", unexpected),
                             ("duplicated tensors", duplicated), ("shape mismatches", mis_shaped))
        if names
    ]
    if problems:
        raise ValueError("checkpoint does not match the model; " + "; ".join(problems))
    return list(entries.values())

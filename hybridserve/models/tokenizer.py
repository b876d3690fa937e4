"""Tokenizer wrapper around a `tokenizers.Tokenizer` (Hugging Face `tokenizer.json`).

`Tokenizer.from_model_dir` reads a model directory; `Tokenizer.byte_level` builds the small
deterministic byte-level BPE tokenizer of the built-in model (nothing to download).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as BackendTokenizer

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
BYTE_LEVEL_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Byte-level layout: ids 0-255 are the bytes, the special tokens follow at fixed ids, then the
# trained merges, then syllable pieces (printable text) up to the vocab size.
ENDOFTEXT_ID = 256
IM_START_ID = 257
IM_END_ID = 258
# Markup the Qwen3.5 chat template and parsers use; plain (non-special) tokens at the end of the
# built-in vocabulary, so they survive decoding with skip_special_tokens.
TEXT_MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# The built-in model's template in the Qwen3.5 layout: tools in the system turn, calls as
# `<tool_call><function=...><parameter=...>`, results as `<tool_response>` user turns, and a thinking
# block the generation prompt opens (closed empty when `enable_thinking` is false).
QWEN3_5_STYLE_TEMPLATE = Path(__file__).with_name("builtin_chat_template.jinja").read_text(encoding="utf-8")

# Qwen's pre-tokenization regex (letters, digits one at a time, punctuation runs, whitespace).
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# The text the built-in tokenizer's merges are learned from
_TRAINING_TEXT = Path(__file__).with_name("builtin_tokenizer_text.txt").read_text(encoding="utf-8")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: each byte maps to a printable unicode character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # in byte order, after U+00FF
    return {b: chr(b) for b in printable} | {b: chr(256 + extra) for extra, b in enumerate(others)}


_ONSETS = ("", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "y", "z",
           "br", "ch", "cl", "cr", "dr", "fl", "fr", "gr", "pl", "pr", "sh", "sl", "sp", "st", "th", "tr", "wh")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou")
_CODAS = ("", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck")


def _syllable_pieces(byte_chars: Mapping[int, str]) -> Iterable[str]:
    """Pronounceable pieces in byte-level spelling, each first as a word start (leading space)
    then as a word continuation, in a fixed order (onset x vowel x coda)."""
    space = byte_chars[ord(" ")]
    for coda in _CODAS:
        for onset in _ONSETS:
            for vowel in _VOWELS:
                syllable = onset + vowel + coda
                yield space + syllable
                yield syllable


def _token_content(value: Any) -> str | None:
    """A token in tokenizer_config.json is a string or an AddedToken dict with `content`."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; ValueError when it cannot be read or holds something else."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _pick_chat_template(value: Any) -> str | None:
    """`chat_template` is a string or a list of {name, template} (the `default` one is used)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        return named.get("default")
    return None


class Tokenizer:
    """Text <-> token ids, special tokens, eos ids and the chat template of a model."""

    def __init__(self, backend: BackendTokenizer, *, eos_token_ids: Iterable[int] = (), eos_token: str | None = None,
                 bos_token: str | None = None, chat_template: str | None = None) -> None:
        self.backend = backend  # the wrapped `tokenizers.Tokenizer`
        # tokenizer eos, generation config and merged extra ids, each once
        self.eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self._eos_token = eos_token
        self._bos_token = bos_token
        self.chat_template = chat_template  # Jinja source, if the model has one
        self._compiled_template: jinja2.Template | None = None
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)  # added tokens included

    @classmethod
    def from_model_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` plus the optional `tokenizer_config.json`, `chat_template.jinja`
        and `generation_config.json` (its eos ids are merged in) of a Hugging Face model dir."""
        model_dir = Path(path)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"no tokenizer.json in {model_dir}")
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        config_file = model_dir / "tokenizer_config.json"
        config = read_json_object(config_file) if config_file.is_file() else {}
        _add_declared_tokens(backend, config.get("added_tokens_decoder") or {})

        eos_token = _token_content(config.get("eos_token"))
        eos_ids: list[int] = []
        if eos_token is not None:
            eos_id = backend.token_to_id(eos_token)
            if eos_id is None:
                raise ValueError(f"eos_token {eos_token!r} of {config_file} is not in the vocabulary")
            eos_ids.append(eos_id)
        generation_file = model_dir / "generation_config.json"
        if generation_file.is_file():
            eos_ids += _as_id_list(read_json_object(generation_file).get("eos_token_id"))

        template = _pick_chat_template(config.get("chat_template"))
        template_file = model_dir / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        return cls(backend, eos_token_ids=eos_ids, eos_token=eos_token,
                   bos_token=_token_content(config.get("bos_token")), chat_template=template)

    @classmethod
    def byte_level(cls, vocab_size: int, *, training_text: str = _TRAINING_TEXT) -> Tokenizer:
        """Deterministic byte-level BPE tokenizer of exactly `vocab_size` ids (the built-in model's).

        Ids 0-255 are the bytes, 256-258 the special tokens, then the merges learned from
        `training_text`, then syllable pieces (" bra", "stoo": decodable, never produced by encoding),
        then the `TEXT_MARKERS` as the last ids, so every id decodes to visible text.
        """
        first_merge_id = 256 + len(BYTE_LEVEL_SPECIAL_TOKENS)
        if vocab_size < first_merge_id:
            raise ValueError(f"byte-level vocab_size must be >= {first_merge_id}, got {vocab_size}")
        byte_chars = _bytes_to_unicode()
        vocab = {byte_chars[b]: b for b in range(256)}
        vocab.update({tok: 256 + i for i, tok in enumerate(BYTE_LEVEL_SPECIAL_TOKENS)})
        merges: list[tuple[str, str]] = []
        for left, right in _train_merges(training_text, vocab_size):
            if len(vocab) == vocab_size:
                break
            if left + right not in vocab:
                vocab[left + right] = len(vocab)
                merges.append((left, right))
        pieces_end = vocab_size - len(TEXT_MARKERS)
        for piece in _syllable_pieces(byte_chars):
            if len(vocab) >= pieces_end:
                break
            vocab.setdefault(piece, len(vocab))
        if len(vocab) < pieces_end:
            raise ValueError(f"byte-level vocab_size {vocab_size} is larger than this tokenizer can fill")
        vocab.update({marker: pieces_end + i for i, marker in enumerate(TEXT_MARKERS)})

        backend = _byte_level_backend(models.BPE(vocab=vocab, merges=merges))
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_LEVEL_SPECIAL_TOKENS])
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_MARKERS])
        return cls(backend, eos_token_ids=(ENDOFTEXT_ID, IM_END_ID), eos_token=IM_END,
                   chat_template=QWEN3_5_STYLE_TEMPLATE)

    def with_extra_eos_token_ids(self, ids: Iterable[int]) -> Tokenizer:
        """A copy whose eos ids are this tokenizer's plus `ids` (e.g. the model config's)."""
        return Tokenizer(self.backend, eos_token_ids=(*self.eos_token_ids, *ids), eos_token=self._eos_token,
                         bos_token=self._bos_token, chat_template=self.chat_template)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no BOS/EOS is added (special-token strings in it are matched)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids outside the vocabulary (a padded model vocab) are dropped."""
        size = self.vocab_size
        if not all(0 <= i < size for i in ids):
            ids = [int(i) for i in ids if 0 <= int(i) < size]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (e.g. a special token), None if absent."""
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` ([{role, content}, ...]) with the chat template into prompt text."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        return self._compiled_template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            eos_token=self._eos_token or "", bos_token=self._bos_token or "", **kwargs,
        )

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the special added tokens."""
        return frozenset(i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special)

    def save(self, out_dir: str | Path) -> None:
        """Write `tokenizer.json` and a `tokenizer_config.json` that transformers can read."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(out / "tokenizer.json"))
        added = {
            str(i): {"content": tok.content, "special": tok.special, "normalized": tok.normalized,
                     "lstrip": tok.lstrip, "rstrip": tok.rstrip, "single_word": tok.single_word}
            for i, tok in sorted(self.backend.get_added_tokens_decoder().items())
        }
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self._eos_token, "bos_token": self._bos_token,
            "pad_token": ENDOFTEXT if self.token_to_id(ENDOFTEXT) is not None else self._eos_token,
            "chat_template": self.chat_template, "added_tokens_decoder": added, "model_max_length": 1 << 20,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False),
                                                   encoding="utf-8")


def _byte_level_backend(model: models.BPE) -> BackendTokenizer:
    """A `tokenizers.Tokenizer` with Qwen's byte-level normalizer, pre-tokenizer and decoder."""
    backend = BackendTokenizer(model)
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    return backend


def _train_merges(text: str, vocab_size: int) -> list[tuple[str, str]]:
    """BPE merges learned from `text` by tokenizers' BpeTrainer, in merge order."""
    scratch = _byte_level_backend(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    scratch.train_from_iterator([text], trainer=trainer)
    merges = json.loads(scratch.to_str())["model"]["merges"]
    # Older tokenizers versions serialize a merge as "left right", newer ones as [left, right].
    pairs = [m.split(" ", 1) if isinstance(m, str) else m for m in merges]
    return [(left, right) for left, right in pairs]


def _add_declared_tokens(backend: BackendTokenizer, declared: Mapping[str, Any]) -> None:
    """Add tokens of tokenizer_config's `added_tokens_decoder` missing from tokenizer.json."""
    for id_text, spec in sorted(declared.items(), key=lambda kv: int(kv[0])):
        content = _token_content(spec)
        if content is None or backend.token_to_id(content) is not None:
            continue
        token = AddedToken(content, special=bool(spec.get("special", False)),
                           normalized=bool(spec.get("normalized", False)))
        if token.special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
        if backend.token_to_id(content) != int(id_text):
            raise ValueError(f"added token {content!r} is declared with id {id_text} but gets id "
                             f"{backend.token_to_id(content)}")


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def chat_template_environment() -> ImmutableSandboxedEnvironment:
    """A Jinja environment for chat templates as transformers builds it: an immutable sandbox, trimmed
    blocks, and the `raise_exception`, `strftime_now` and `tojson` helpers Hugging Face templates use."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template (ValueError when it does not)."""
    try:
        return chat_template_environment().from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"invalid chat template: {exc}") from exc

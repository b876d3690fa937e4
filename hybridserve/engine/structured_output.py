"""Structured outputs: grammars compiled by llguidance (`GrammarCompiler`, LRU-cached), applied as
token masks (docs/prefix-cache.md, Structured outputs). Masks are filled on the calling thread and
unpacked by numpy: on a busy CPU a tiny op split across threads waits on descheduled ones."""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, NamedTuple

import llguidance
import llguidance.numpy as llg_numpy  # not llguidance.torch: it runs torch.compile at import (~5 s)
import numpy as np
import torch

from hybridserve.models.tokenizer import Tokenizer
from hybridserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

logger = logging.getLogger(__name__)

# Compact JSON (no free whitespace): a random or weak model cannot wander off into endless spaces.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEFAULT_CACHE_SIZE = 256


class CompileCacheInfo(NamedTuple):
    """Grammar compile cache counters."""

    hits: int
    misses: int
    size: int


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar (JSON-wrapped) for one constraint."""
    if spec.json is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=JSON_OPTIONS)
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        alternatives = " | ".join(json.dumps(choice) for choice in spec.choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    assert spec.grammar is not None
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar)


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe, with a per-constraint LRU cache."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.vocab_size = vocab_size
        self.ll_tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                   eos_token=list(tokenizer.eos_token_ids))
        self.cache_size = cache_size
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    def matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for `spec` (ValueError if the grammar is invalid)."""
        key = spec.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self._hits += 1
                return compiled.deep_copy()
        compiled = self._compile(spec)
        with self._lock:
            self._misses += 1
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled.deep_copy()

    def _compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        try:
            grammar = grammar_text(spec)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"invalid structured output constraint: {exc}") from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid structured output constraint: {matcher.get_error()}")
        return matcher

    def cache_info(self) -> CompileCacheInfo:
        """Hits, misses and entries of the compile cache."""
        with self._lock:
            return CompileCacheInfo(self._hits, self._misses, len(self._cache))


class TokenMasker:
    """Applies the matchers' allowed-token masks to a batch of logits rows."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._bitmask = llg_numpy.allocate_token_bitmask(1, vocab_size)

    def _fill(self, matchers: list[llguidance.LLMatcher]) -> np.ndarray:
        """[len(matchers), words] packed int32 bits of the tokens each matcher allows next."""
        if self._bitmask.shape[0] < len(matchers):
            self._bitmask = llg_numpy.allocate_token_bitmask(len(matchers), self.vocab_size)
        bitmask = self._bitmask[:len(matchers)]
        for row, matcher in enumerate(matchers):
            llg_numpy.fill_next_token_bitmask(matcher, bitmask, row)
        return bitmask

    def bitmask(self, matcher: llguidance.LLMatcher) -> np.ndarray:
        """A copy of the packed allowed-token bits (int32 words) of one matcher's next token."""
        row: np.ndarray = self._fill([matcher])[0].copy()
        return row

    def allowed(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """[len(matchers), vocab] bool: the tokens each matcher allows next."""
        packed = self._fill(matchers).view(np.uint8)  # little-endian words: bit i of a row is token i
        return torch.from_numpy(np.unpackbits(packed, axis=1, count=self.vocab_size, bitorder="little")).bool()

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[llguidance.LLMatcher]) -> None:
        """Set disallowed tokens of `logits[rows[i]]` to -inf, per `matchers[i]` (in place)."""
        if not rows:
            return
        index = torch.tensor(rows, device=logits.device)
        block = logits.index_select(0, index)
        apply_bitmask(block, self._fill(matchers))
        logits.index_copy_(0, index, block)


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray) -> None:
    """Set `logits[i, t]` ([n, vocab]) to -inf wherever bit t of `bitmask[i]` (packed int32 words,
    little-endian bit order) is clear, and every column past the mask's width (in place)."""
    vocab = logits.shape[-1]
    words = np.ascontiguousarray(bitmask, dtype=np.int32).view(np.uint8)
    allowed = np.unpackbits(words, axis=1, count=min(vocab, bitmask.shape[1] * 32), bitorder="little")
    width = allowed.shape[1]
    disallowed = torch.from_numpy(allowed == 0).to(logits.device)
    logits[:, :width].masked_fill_(disallowed, float("-inf"))
    logits[:, width:] = float("-inf")

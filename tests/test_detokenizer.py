"""Incremental detokenization equals a full decode and never takes text back."""

from __future__ import annotations

import random

import pytest

from hybridserve.engine.detokenizer import IncrementalDetokenizer
from hybridserve.models.tokenizer import Tokenizer


@pytest.mark.parametrize("seed", range(5))
def test_incremental_text_is_stable_and_equals_full_decode(builtin_tok: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    text_ids = builtin_tok.encode("héllo wörld, ünïcode ✓ and plain ASCII; 日本語のテキスト too. " * 3)
    ids = text_ids + [rng.randrange(builtin_tok.vocab_size) for _ in range(200)]  # arbitrary bytes too
    detok = IncrementalDetokenizer(builtin_tok)
    seen: list[int] = []
    previous = ""
    for token in ids:
        seen.append(token)
        delta = detok.update(seen)
        assert detok.text == previous + delta          # only ever appended
        previous = detok.text
        if len(seen) == len(text_ids):
            assert detok.text == builtin_tok.decode(text_ids)  # complete characters all emitted
    detok.finish(seen)
    assert detok.text == builtin_tok.decode(ids)


def test_held_back_partial_character(builtin_tok: Tokenizer) -> None:
    snowman = "☃".encode()  # three bytes; the built-in tokenizer has a token per byte
    ids = [b for b in snowman]
    detok = IncrementalDetokenizer(builtin_tok)
    assert detok.update(ids[:1]) == "" and detok.update(ids[:2]) == ""
    assert detok.update(ids) == "☃"

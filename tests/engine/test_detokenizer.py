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


def _stream_in_steps(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> None:
    """Feed `ids` in updates of 1-4 tokens, checking the text is only ever appended to."""
    end = 0
    while end < len(ids):
        end = min(len(ids), end + rng.randrange(1, 5))
        before = detok.text
        delta = detok.update(ids[:end])
        assert detok.text == before + delta


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_multi_token_updates_and_ids_past_the_vocab(builtin_tok: Tokenizer, skip_special_tokens: bool) -> None:
    rng = random.Random(7)
    size = builtin_tok.vocab_size
    for _ in range(50):
        ids = [rng.randrange(size + 4) for _ in range(60)]  # a padded model vocab samples past the tokenizer's
        detok = IncrementalDetokenizer(builtin_tok, skip_special_tokens)
        _stream_in_steps(detok, ids, rng)
        detok.finish(ids)
        assert detok.text == builtin_tok.decode(ids, skip_special_tokens=skip_special_tokens)


class _RefusingStream:
    """A `DecodeStream` whose decoder refuses its `refuse_at`-th token, as `step` raises when the
    decoder rewrites text it already returned ("Invalid prefix encountered")."""

    def __init__(self, inner: object, refuse_at: int) -> None:
        self.inner, self.refuse_at, self.calls = inner, refuse_at, 0

    def step(self, backend: object, token: int) -> str | None:
        self.calls += 1
        if self.calls == self.refuse_at:
            raise Exception("Invalid prefix encountered")
        return self.inner.step(backend, token)  # type: ignore[attr-defined]


@pytest.mark.parametrize("refuse_at", [1, 5, 37])
def test_a_refused_token_falls_back_to_window_decoding(builtin_tok: Tokenizer, refuse_at: int) -> None:
    rng = random.Random(refuse_at)
    ids = builtin_tok.encode("ünïcode ✓ 日本語 " * 4) + [rng.randrange(builtin_tok.vocab_size) for _ in range(80)]
    detok = IncrementalDetokenizer(builtin_tok)
    refusing = _RefusingStream(detok._stream, refuse_at)
    detok._stream = refusing  # type: ignore[assignment]
    _stream_in_steps(detok, ids, rng)
    assert detok._stream is None and refusing.calls == refuse_at  # no token reached the stream after it
    detok.finish(ids)
    assert detok.text == builtin_tok.decode(ids)

"""Incremental detokenization: a request's text grows without re-decoding all of it each step."""

from __future__ import annotations

from hybridserve.models.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text of a growing token sequence.

    Each update decodes only the window of tokens since the last emitted character boundary
    and appends the new characters once they no longer end in an incomplete UTF-8 sequence
    (U+FFFD), so streamed text never has to be taken back. `finish` flushes what was held.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self._prefix_offset = 0  # window start: the boundary before the last emitted tokens
        self._read_offset = 0    # tokens up to here are reflected in `text`

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, token_ids: list[int]) -> str:
        """Account for new tokens at the end of `token_ids`; returns the text added (maybe "")."""
        prefix_text = self._decode(token_ids[self._prefix_offset:self._read_offset])
        window_text = self._decode(token_ids[self._prefix_offset:])
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = window_text[len(prefix_text):]
        self.text += delta
        self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
        return delta

    def finish(self, token_ids: list[int]) -> str:
        """Flush held-back characters (an incomplete sequence at the end becomes U+FFFD)."""
        prefix_text = self._decode(token_ids[self._prefix_offset:self._read_offset])
        window_text = self._decode(token_ids[self._prefix_offset:])
        delta = window_text[len(prefix_text):] if len(window_text) > len(prefix_text) else ""
        self.text += delta
        self._prefix_offset = self._read_offset = len(token_ids)
        return delta

"""Incremental detokenization: a request's text grows without re-decoding all of it each step."""

from __future__ import annotations

import logging

from tokenizers.decoders import DecodeStream

from hybridserve.models.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"

logger = logging.getLogger(__name__)


class IncrementalDetokenizer:
    """Text of a growing token sequence.

    New characters are appended once they no longer end in an incomplete UTF-8 sequence (U+FFFD),
    so streamed text never has to be taken back. Each new token goes through the tokenizer's own
    `DecodeStream` (one call into Rust per token, cheaper than two window decodes). Should the stream
    refuse a token (its decoder rewrote emitted text), the request carries on with window decodes:
    the text since the last emitted boundary, decoded with and without the new tokens. `finish`
    flushes what was held (an incomplete sequence becomes U+FFFD).

    Work per update is bounded by the new tokens: the text is kept as a list of pieces (appending
    to one growing string would copy it each time), joined only when `text` is read.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._pieces: list[str] = []
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stepped = 0        # tokens of the sequence given to the stream
        self._prefix_offset = 0  # window start: the boundary before the last emitted tokens
        self._read_offset = 0    # tokens up to here are reflected in `text`

    @property
    def text(self) -> str:
        """All text emitted so far (joined once per change, then kept as one piece)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def _emit(self, piece: str) -> None:
        self._pieces.append(piece)

    def update(self, token_ids: list[int]) -> str:
        """Account for new tokens at the end of `token_ids`; returns the text added (maybe "")."""
        if self._stream is None:
            return self._window_update(token_ids)
        start = len(self._pieces)
        backend, size = self.tokenizer.backend, self.tokenizer.vocab_size
        for position in range(self._stepped, len(token_ids)):
            token = token_ids[position]
            if not 0 <= token < size:  # a padded model vocab's id: dropped, as `Tokenizer.decode` does
                continue
            try:
                piece = self._stream.step(backend, token)
            except Exception as error:  # noqa: BLE001 - the tokenizer's own refusal; the window copes
                logger.debug("DecodeStream refused a token (%s); window decoding from here", error)
                self._stream = None
                self._window_update(token_ids)
                return "".join(self._pieces[start:])
            if piece:
                self._emit(piece)
                self._prefix_offset, self._read_offset = self._read_offset, position + 1
        self._stepped = len(token_ids)
        return "".join(self._pieces[start:])

    def finish(self, token_ids: list[int]) -> str:
        """Flush held-back characters (an incomplete sequence at the end becomes U+FFFD)."""
        self.update(token_ids)
        prefix_text = self._decode(token_ids[self._prefix_offset:self._read_offset])
        window_text = self._decode(token_ids[self._prefix_offset:])
        delta = window_text[len(prefix_text):] if len(window_text) > len(prefix_text) else ""
        self._emit(delta)
        self._prefix_offset = self._read_offset = self._stepped = len(token_ids)
        self._stream = None  # a finished sequence takes no more tokens
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _window_update(self, token_ids: list[int]) -> str:
        prefix_text = self._decode(token_ids[self._prefix_offset:self._read_offset])
        window_text = self._decode(token_ids[self._prefix_offset:])
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = window_text[len(prefix_text):]
        self._emit(delta)
        self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
        return delta

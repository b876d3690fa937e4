"""The SSE fast path writes the same bytes as the pydantic models it stands in for."""

from __future__ import annotations

import random

import pytest

from hybridserve.server.protocol import (
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionStreamResponse,
    DeltaMessage,
)
from hybridserve.server.sse import TextChunkTemplate, sse_event

TEXTS = ["", "a", " hello", '"quoted" \\ back', "line\nbreak\ttab\rret", "\x00\x01\x1f\x7f", "\u2028\u2029",
         "é漢字😀\U0010ffff", "</script>&<>", "{\"json\": [1, 2]}"]


def _completion(index: int, text: str) -> CompletionStreamResponse:
    return CompletionStreamResponse(id="cmpl-1", model="m\"odel", created=1700000000,
                                    choices=[CompletionChoice(index=index, text=text)])


def _chat(index: int, text: str) -> ChatCompletionStreamResponse:
    return ChatCompletionStreamResponse(id="chatcmpl-1", model="m", created=1700000000,
                                        choices=[ChatStreamChoice(index=index, delta=DeltaMessage(content=text))])


@pytest.mark.parametrize("build", [_completion, _chat])
def test_text_chunk_template_matches_pydantic(build) -> None:
    template = TextChunkTemplate(build)
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(0, 0x250)] + ["\u2028", "😀", "\ufeff", "漢"]
    randoms = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(300)]
    for index in (0, 1, 7, 12345):
        for text in TEXTS + randoms:
            assert template.event(index, text) == sse_event(build(index, text))


def test_text_chunk_template_needs_both_marks() -> None:
    with pytest.raises(ValueError, match="index once"):
        TextChunkTemplate(lambda index, text: _completion(0, text))

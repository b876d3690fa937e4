"""Server-sent events of a streamed response: the response that sends them, and a fast path for
text-only chunks.

Most chunks carry one token's text and nothing else, and building their pydantic models dominated
the API process's work per token: `TextChunkTemplate` dumps such a chunk once and afterwards writes
only the choice index and the escaped text (byte-identical to pydantic's JSON; tests/server/test_sse.py
checks it). Every other chunk goes through its model.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from json.encoder import (
    encode_basestring,  # json.dumps(text, ensure_ascii=False) without its per-call set-up
)
from typing import Any

from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse
from starlette.types import Send

_TEXT_MARK = "\x01hybridserve-text\x01"
_INDEX_MARK = 987_654_321


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    """One SSE event carrying `payload` as JSON."""
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


class TextChunkTemplate:
    """The SSE event of a text-only chunk for any choice index and text, without pydantic per chunk.

    `build(index, text)` must return the chunk model whose only variable fields are that choice
    index and text; the template is cut from its JSON once, at construction.
    """

    __slots__ = ("_head", "_middle", "_tail")

    def __init__(self, build: Callable[[int, str], BaseModel]) -> None:
        dumped = build(_INDEX_MARK, _TEXT_MARK).model_dump_json()
        index_at = dumped.find(str(_INDEX_MARK))
        text_json = encode_basestring(_TEXT_MARK)
        text_at = dumped.find(text_json)
        if not 0 <= index_at < text_at or dumped.count(str(_INDEX_MARK)) != 1 or dumped.count(text_json) != 1:
            raise ValueError("a text chunk template needs the index once, before the text once")
        self._head = "data: " + dumped[:index_at]
        self._middle = dumped[index_at + len(str(_INDEX_MARK)):text_at]
        self._tail = dumped[text_at + len(text_json):] + "\n\n"

    def event(self, index: int, text: str) -> str:
        """The SSE event of the chunk carrying `text` for choice `index`."""
        return f"{self._head}{index}{self._middle}{encode_basestring(text)}{self._tail}"


SendEvent = Callable[[str], Awaitable[None]]
"""Sends one SSE event (already framed) to the client."""


async def _no_body() -> AsyncIterator[bytes]:
    return
    yield b""  # pragma: no cover - makes this an async generator


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response whose events `write_events(send_event)` sends one by one: the
    producer awaits each send itself instead of two async-generator hops per token. Disconnect
    handling and the background task are `StreamingResponse`'s own."""

    def __init__(self, write_events: Callable[[SendEvent], Awaitable[None]],
                 background: BackgroundTask | None = None) -> None:
        super().__init__(_no_body(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, background=background)
        self._write_events = write_events

    async def stream_response(self, send: Send) -> None:
        """Start the response, let the producer send its events, then end the body."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

        async def send_event(event: str) -> None:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})

        await self._write_events(send_event)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

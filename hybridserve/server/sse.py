"""Server-sent events of a streamed response, and a fast path for the common chunk that carries
one token's text and nothing else: `TextChunkTemplate` writes it without building pydantic models
(which dominated the API process's work per token), byte-identical to pydantic's JSON."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
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
    """The SSE event of a text-only chunk, cut once from the JSON of `build(index, text)`: the chunk
    model whose only variable fields are that choice index and text."""

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


SendEvent = Callable[[str], Awaitable[None]]  # sends one SSE event (already framed) to the client


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response whose producer `write_events(send_event)` awaits each send
    itself (no async-generator hops per token); disconnects and the background task as Starlette's."""

    def __init__(self, write_events: Callable[[SendEvent], Awaitable[None]],
                 background: BackgroundTask | None = None) -> None:
        super().__init__((), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, background=background)
        self._write_events = write_events

    async def stream_response(self, send: Send) -> None:
        """Start the response, let the producer send its events, then end the body."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

        async def send_event(event: str) -> None:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})

        await self._write_events(send_event)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

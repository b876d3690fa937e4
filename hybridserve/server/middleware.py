"""The request body size cap, a pure-ASGI middleware (bearer-key auth is `server.auth`)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hybridserve.server.errors import APIError

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class BodyLimitMiddleware:
    """Reads the whole request body up front (at most `max_body_bytes`, else 413) and replays it."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check_declared_length(scope)
            body = await self._read_body(receive)
        except APIError as error:
            await error.send(send)
            return
        if body is None:  # client left while sending
            return
        await self.app(scope, _replay(body, receive), send)

    def _too_large(self) -> APIError:
        return APIError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes",
                        code="request_too_large")

    def _check_declared_length(self, scope: Scope) -> None:
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is None:
            return
        if not declared.isdigit():
            raise APIError(400, "invalid Content-Length header")
        if int(declared) > self.max_body_bytes:
            raise self._too_large()

    async def _read_body(self, receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that first yields the buffered body, then defers to the server (disconnects)."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


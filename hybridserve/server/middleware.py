"""Pure-ASGI middlewares: the request body size cap, and request ids with the access log
(bearer-key auth is `server.auth`); `log_safe` for any logged value that comes from a request."""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hybridserve.server.errors import APIError
from hybridserve.server.limits import DEFAULT_LIMITS

DEFAULT_MAX_BODY_BYTES = DEFAULT_LIMITS.max_body_bytes
REQUEST_ID_HEADER = b"x-request-id"
REQUEST_ID_SCOPE_KEY = "hybridserve.request_id"
LOGGED_CHARS = 80  # a logged value from a request is cut to this many characters
_SANE_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:\-]{1,64}")

access_logger = logging.getLogger("hybridserve.access")


def log_safe(value: object, limit: int = LOGGED_CHARS) -> str:
    """`value` as text fit for one log line: control and non-ASCII characters escaped (no forged
    lines, no terminal escapes), cut to `limit` characters with a marker saying so."""
    text = str(value)
    cut = text[:limit].encode("unicode_escape").decode("ascii")
    return cut if len(text) <= limit else f"{cut}...(+{len(text) - limit} chars)"


class RequestIdMiddleware:
    """Gives every request an id (the client's `x-request-id` when it is short and plain, else a
    new one), returns it as the `x-request-id` response header, and writes one access-log line
    per request with it: client, method, path (escaped), status, seconds."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == REQUEST_ID_HEADER), b"")
        request_id = given.decode() if _SANE_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope[REQUEST_ID_SCOPE_KEY] = request_id
        status = 0
        start = time.monotonic()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (REQUEST_ID_HEADER, request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            client = scope.get("client") or ("-", 0)
            access_logger.info('%s:%s "%s %s" %d %.3fs request_id=%s', client[0], client[1], scope["method"],
                               log_safe(scope["path"]), status, time.monotonic() - start, request_id)


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


"""`APIError` (answered with the OpenAI error envelope), engine exceptions mapped onto it by class,
and the exception handlers that answer every error, unknown routes and invalid bodies included,
with that envelope."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from hybridserve.errors import HybridServeError, http_error_fields
from hybridserve.sampling_params import RequestOutput
from hybridserve.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                   500: "server_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """An error to answer with the OpenAI envelope."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 error_type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPE_BY_STATUS.get(status, "invalid_request_error")
        self.headers = headers or {}

    def envelope(self) -> bytes:
        """JSON body of the error."""
        info = ErrorInfo(message=self.message, type=self.error_type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump_json().encode()

    def response(self) -> Response:
        """The HTTP response for this error."""
        return Response(self.envelope(), status_code=self.status, headers=self.headers,
                        media_type="application/json")

    async def send(self, send: Send) -> None:
        """Send as a raw ASGI response (for middlewares that sit outside FastAPI)."""
        headers = [(b"content-type", b"application/json")]
        headers += [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.envelope()})


def engine_error(exc: BaseException) -> APIError:
    """Map an engine exception onto an HTTP error by its class (see `hybridserve.errors`)."""
    if isinstance(exc, APIError):
        return exc
    fields = http_error_fields(exc)
    return APIError(fields.status, fields.message, code=fields.code, headers=fields.headers)


def request_failed(output: RequestOutput) -> APIError:
    """The error event of a request the engine ended with finish_reason "error"."""
    return APIError(500, f"request {output.request_id} failed in the engine (non-finite logits, a sampler "
                    f"or a detokenizer error); other requests are unaffected", code="request_failed")


def validation_error(exc: RequestValidationError) -> APIError:
    """The 400 answer to a body that does not parse or validate."""
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": (), "type": ""}
    if first.get("type") == "json_invalid":
        context = first.get("ctx")
        detail = context.get("error", "") if isinstance(context, dict) else ""
        return APIError(400, f"malformed JSON body: {detail}".strip(), code="invalid_json")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if not loc and first.get("type") == "missing":
        return APIError(400, "a JSON request body is required")
    if not loc and first.get("type") in ("model_attributes_type", "model_type", "dict_type"):
        return APIError(400, "the request body must be a JSON object (Content-Type: application/json)",
                        code="invalid_body")
    if not loc:
        return APIError(400, f"invalid request: {msg}", code="invalid_value")
    return APIError(400, f"invalid field {'.'.join(loc)}: {msg}", param=loc[0], code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error with the OpenAI envelope."""

    async def on_api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    async def on_validation(_: Request, exc: RequestValidationError) -> Response:
        return validation_error(exc).response()

    async def on_http(_: Request, exc: StarletteHTTPException) -> Response:
        message = "route not found" if exc.status_code == 404 else str(exc.detail)
        return APIError(exc.status_code, message, headers=dict(exc.headers or {})).response()

    async def on_engine(_: Request, exc: Exception) -> Response:
        return engine_error(exc).response()

    async def on_unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error", exc_info=exc)
        return APIError(500, "internal server error").response()

    # Starlette types every handler as taking `Exception` but calls each with its own class.
    app.add_exception_handler(APIError, on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, on_validation)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http)  # type: ignore[arg-type]
    app.add_exception_handler(HybridServeError, on_engine)
    app.add_exception_handler(Exception, on_unexpected)


# Documented in /openapi.json: every error answers with the OpenAI envelope.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 503)}

"""The one error vocabulary of `LLM`, the engine, the engine core process and the HTTP server.

Each class declares the HTTP status and OpenAI `code` it is answered with (`http_error_fields`) and
crosses the process boundary by name, as its *kind* (`error_kind`, `error_from_kind`). Bad input is
an `InvalidRequestError`, which is also a `ValueError`.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

RETRY_AFTER_SECONDS = 1  # the Retry-After header of an answer to a retryable error


class HybridServeError(Exception):
    """Base of every hybridserve error. `http_status` and `code` are what the server answers with;
    `retryable` errors also carry a Retry-After header."""

    http_status: ClassVar[int] = 500
    code: ClassVar[str | None] = "engine_error"
    retryable: ClassVar[bool] = False


class InvalidRequestError(HybridServeError, ValueError):
    """A request, prompt or parameter is invalid (HTTP 400)."""

    http_status = 400
    code = None


class SamplingParamsTypeError(InvalidRequestError, TypeError):
    """A sampling parameter has the wrong type. Also a `TypeError`, so callers catching either of
    the built-in errors see it."""


class QueueFullError(HybridServeError, RuntimeError):
    """Too many requests are waiting to be scheduled; retry later (HTTP 503 with Retry-After)."""

    http_status = 503
    code = "server_overloaded"
    retryable = True


EngineOverloadedError = QueueFullError  # the name the async front ends used for the same condition


class EngineDeadError(HybridServeError, RuntimeError):
    """The engine stopped (shut down, a tensor-parallel worker or the engine core process died);
    it serves nothing until restarted (HTTP 503 with Retry-After)."""

    http_status = 503
    code = "engine_unavailable"
    retryable = True


class EngineStepError(HybridServeError, RuntimeError):
    """A scheduling step raised; the requests in flight were failed, others carry on (HTTP 500,
    the base's status and code)."""


class RequestAbortedError(HybridServeError):
    """The request was aborted before it finished (the client went away: HTTP 499)."""

    http_status = 499
    code = "client_closed_request"


# Exception kinds that cross the process boundary by name. Built-in kinds keep their own class
# (`OSError` from a missing model file, `AssertionError` from an integrity check); anything else
# arrives as a `RuntimeError`.
WIRE_KINDS: dict[str, type[Exception]] = {
    kind.__name__: kind for kind in (
        SamplingParamsTypeError, InvalidRequestError, QueueFullError, EngineDeadError, EngineStepError,
        RequestAbortedError, OSError, AssertionError, RuntimeError)
}


def error_kind(exc: BaseException) -> str:
    """The kind `exc` travels as: its own class when declared in `WIRE_KINDS`, else its nearest
    declared base (any other `ValueError` is an `InvalidRequestError`), else "RuntimeError"."""
    for cls in type(exc).__mro__:
        if cls.__name__ in WIRE_KINDS and WIRE_KINDS[cls.__name__] is cls:
            return cls.__name__
        if cls is ValueError:
            return InvalidRequestError.__name__
    return RuntimeError.__name__


def error_from_kind(kind: str, message: str) -> Exception:
    """The exception to raise for a kind received from the other process."""
    return WIRE_KINDS.get(kind, RuntimeError)(message)


class HttpErrorFields(NamedTuple):
    """How the server answers an exception: status, message, OpenAI error code, extra headers."""

    status: int
    message: str
    code: str | None
    headers: dict[str, str]


def http_error_fields(exc: BaseException) -> HttpErrorFields:
    """The HTTP answer to an exception, by its class: a `HybridServeError` declares it; any other
    `ValueError` is bad input (400); anything else is an internal error (500)."""
    if isinstance(exc, HybridServeError):
        status, code = exc.http_status, exc.code
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if exc.retryable else {}
    elif isinstance(exc, ValueError):
        status, code, headers = 400, None, {}
    else:
        status, code, headers = 500, "engine_error", {}
    message = f"internal error: {exc}" if status == 500 else str(exc)
    return HttpErrorFields(status, message, code, headers)


__all__ = [
    "RETRY_AFTER_SECONDS", "WIRE_KINDS", "EngineDeadError", "EngineOverloadedError", "EngineStepError",
    "HttpErrorFields", "HybridServeError", "InvalidRequestError", "QueueFullError", "RequestAbortedError",
    "SamplingParamsTypeError", "error_from_kind", "error_kind", "http_error_fields",
]

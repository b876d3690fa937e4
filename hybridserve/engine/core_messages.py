"""Messages between the API process (`EngineCoreClient`) and the engine core process (`EngineCore`).

msgpack-encoded `msgspec` structs, one tagged union per direction. The hot path is
`StepOutputs`: per step, only what is new for each request that advanced (new token ids, the
text appended, new logprob rows, finish reasons), never the cumulative output. Payloads that
occur once per request or per utility call (`SamplingParams`, arbitrary results) travel as
pickled bytes inside a struct: they are rare, and pickle keeps their exact Python types.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec


# ----------------------------------------------------------------------------- API -> core
class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """Queue a request; the core answers with `AddResult`."""

    request_id: str
    prompt: str | list[int]
    params: bytes  # pickled SamplingParams
    cache_salt: str | None


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """Abort requests (unknown or finished ids are ignored); no answer."""

    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="call", array_like=True):
    """Run `fn(engine)` between steps (`fn` pickled: a method name or a picklable callable);
    the core answers with `UtilityResult`."""

    call_id: int
    fn: bytes


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Stop the loop, fail what is in flight and exit."""


CoreInput = AddRequest | AbortRequests | UtilityCall | Shutdown


# ----------------------------------------------------------------------------- core -> API
class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The engine is built; `info` is a pickled `CoreInfo`."""

    info: bytes


class StartupFailed(msgspec.Struct, tag="startup_failed", array_like=True):
    """Building the engine raised; `kind` is the exception class name."""

    kind: str
    message: str


class AddResult(msgspec.Struct, tag="added", array_like=True):
    """The answer to `AddRequest`: `error_kind` is None when queued, else the exception class
    ("ValueError", "QueueFullError", ...) with its message."""

    request_id: str
    error_kind: str | None = None
    message: str = ""


class UtilityResult(msgspec.Struct, tag="result", array_like=True):
    """The answer to `UtilityCall`: a pickled value, or an error."""

    call_id: int
    value: bytes = b""
    error_kind: str | None = None
    message: str = ""


class CompletionDelta(msgspec.Struct, array_like=True):
    """What is new for one of a request's `n` completions since the previous step.

    The text becomes `previous[:text_start] + text`: normally `text_start` is the previous
    length (an append); a stop string found at the end cuts text that was already reported.
    """

    index: int
    token_ids: list[int]
    text_start: int
    text: str
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: str | int | None


class RequestDelta(msgspec.Struct, array_like=True):
    """One request that advanced in a step. `prompt_token_ids` and `prompt` come once, in the
    request's first delta."""

    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int
    first_token_time: float | None
    prompt_token_ids: list[int] | None = None


class StepOutputs(msgspec.Struct, tag="step", array_like=True):
    """Everything one step produced; `num_waiting` lets the client bound its admission queue."""

    deltas: list[RequestDelta]
    num_waiting: int


class StepFailed(msgspec.Struct, tag="step_failed", array_like=True):
    """A step raised: these requests were aborted and fail with the message; others carry on."""

    request_ids: list[str]
    message: str


class EngineDead(msgspec.Struct, tag="engine_dead", array_like=True):
    """The engine cannot step again (e.g. a tensor-parallel worker died); the core exits."""

    reason: str


CoreOutput = Ready | StartupFailed | AddResult | UtilityResult | StepOutputs | StepFailed | EngineDead


class CoreInfo(NamedTuple):
    """What the API process needs from the engine without running it (sent pickled in `Ready`)."""

    tokenizer: Any
    model_config: Any
    max_model_len: int
    max_request_tokens: int
    stats: dict[str, float]


def input_encoder() -> msgspec.msgpack.Encoder:
    """Encoder for either direction (structs know their tags)."""
    return msgspec.msgpack.Encoder()


def input_decoder() -> msgspec.msgpack.Decoder:
    """Decoder of API -> core messages."""
    return msgspec.msgpack.Decoder(CoreInput)


def output_decoder() -> msgspec.msgpack.Decoder:
    """Decoder of core -> API messages."""
    return msgspec.msgpack.Decoder(CoreOutput)

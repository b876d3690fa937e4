"""Messages between the API process (`CoreClient`) and the engine core (`EngineCore`): msgspec
structs, one tagged union per direction, typed end to end (errors travel as a kind from
`hybridserve.errors.WIRE_KINDS`). Nothing the API process sends is pickled; the core's `Ready`
carries the pickled tokenizer. Per step only what is new travels, never the cumulative output."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from hybridserve.config import ModelConfig
from hybridserve.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)


# ----------------------------------------------------------------------------- sampling parameters
class StructuredOutputsWire(msgspec.Struct, array_like=True):
    """`StructuredOutputsParams` on the wire (same fields; `json` already parsed to a dict)."""

    json: dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingParamsWire(msgspec.Struct, array_like=True):
    """`SamplingParams` on the wire, field for field (a field added to one only fails at once)."""

    n: int
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    min_tokens: int
    logprobs: int | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    structured_outputs: StructuredOutputsWire | None
    logit_bias: dict[int, float] | None
    output_kind: int
    stream_interval: int
    prompt_logprobs: int | None


def params_to_wire(params: SamplingParams) -> SamplingParamsWire:
    """The wire form of validated `SamplingParams`."""
    values = {field.name: getattr(params, field.name) for field in dataclasses.fields(params)}
    constraint = params.structured_outputs
    values["structured_outputs"] = None if constraint is None else StructuredOutputsWire(
        **{field.name: getattr(constraint, field.name) for field in dataclasses.fields(constraint)})
    values["output_kind"] = int(params.output_kind)
    return SamplingParamsWire(**values)


def params_from_wire(wire: SamplingParamsWire) -> SamplingParams:
    """`SamplingParams` from their wire form, validated again (`ValueError` on a bad value)."""
    values = msgspec.structs.asdict(wire)
    constraint = wire.structured_outputs
    values["structured_outputs"] = None if constraint is None else StructuredOutputsParams(
        **msgspec.structs.asdict(constraint))
    values["output_kind"] = RequestOutputKind(wire.output_kind)
    return SamplingParams(**values)


# ----------------------------------------------------------------------------- API -> core
class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """Queue a request; the core answers with `AddResult`."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParamsWire
    cache_salt: str | None


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """Abort requests (unknown or finished ids are ignored); no answer."""

    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="call", array_like=True):
    """Between steps, call the engine's public method (or read its attribute); answer: `UtilityResult`."""

    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Stop the loop, fail what is in flight and exit."""


CoreInput = AddRequest | AbortRequests | UtilityCall | Shutdown


# ----------------------------------------------------------------------------- core -> API
class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The engine is built: what the API process needs from it (`tokenizer` is pickled: a
    third-party object without a typed form)."""

    model_config: ModelConfig
    max_model_len: int
    max_request_tokens: int
    stats: dict[str, Any]
    tokenizer: bytes


class StartupFailed(msgspec.Struct, tag="startup_failed", array_like=True):
    """Building the engine raised; `kind` is its kind (`hybridserve.errors.error_kind`)."""

    kind: str
    message: str


class AddResult(msgspec.Struct, tag="added", array_like=True):
    """The answer to `AddRequest`: `error_kind` is None when queued, else the exception's kind."""

    request_id: str
    error_kind: str | None = None
    message: str = ""


class UtilityResult(msgspec.Struct, tag="result", array_like=True):
    """The answer to `UtilityCall`: a msgpack-encodable value, or an error."""

    call_id: int
    value: Any = None
    error_kind: str | None = None
    message: str = ""


class CompletionDelta(msgspec.Struct, array_like=True):
    """What is new for one of a request's `n` completions since the previous step. The text
    becomes `previous[:text_start] + text` (a stop string can cut text already reported)."""

    index: int
    token_ids: list[int]
    text_start: int
    text: str
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: str | int | None


class RequestDelta(msgspec.Struct, array_like=True):
    """One request that advanced in a step; `prompt_token_ids` and `prompt_logprobs` (when asked:
    complete by then, as the first delta follows the prefill) come in its first delta only."""

    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int
    first_token_time: float | None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None


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


class Heartbeat(msgspec.Struct, tag="beat", array_like=True):
    """The core is alive: sent every `core.HEARTBEAT_INTERVAL_S` by a thread of the core, so a
    long step does not delay it but a stopped or frozen process does."""


CoreOutput = Ready | StartupFailed | AddResult | UtilityResult | StepOutputs | StepFailed | EngineDead | Heartbeat


def input_decoder() -> msgspec.msgpack.Decoder[CoreInput]:
    """Decoder of API -> core messages."""
    return msgspec.msgpack.Decoder(CoreInput)


def output_decoder() -> msgspec.msgpack.Decoder[CoreOutput]:
    """Decoder of core -> API messages."""
    return msgspec.msgpack.Decoder(CoreOutput)

"""`SamplingParams`, `StructuredOutputsParams` (vLLM-shaped) and `RequestOutput` / `CompletionOutput`,
the public request/response types."""

from __future__ import annotations

import enum
import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from hybridserve.errors import SamplingParamsTypeError

__all__ = ["MAX_LOGPROBS", "MAX_N", "MAX_STREAM_INTERVAL", "CompletionOutput", "RequestOutput", "RequestOutputKind",
           "SamplingParams", "SamplingParamsTypeError", "StructuredOutputsParams"]

MAX_N = 64
MAX_LOGPROBS = 20  # top alternatives per token of `logprobs` and `prompt_logprobs`, at most
MAX_STREAM_INTERVAL = 1 << 16  # tokens between two outputs of a stream, at most


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output with a grammar: exactly one of the fields (docs/python-api.md)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                             f"got {given or 'none'}")
        _check_type("structured_outputs.json", self.json, (dict, str, type(None)))
        _check_type("structured_outputs.regex", self.regex, (str, type(None)))
        _check_type("structured_outputs.grammar", self.grammar, (str, type(None)))
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            if not all(isinstance(c, str) for c in self.choice):
                raise SamplingParamsTypeError("structured_outputs.choice must hold strings only")
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(self.json, dict):
                raise SamplingParamsTypeError("structured_outputs.json must be a JSON object (a schema)")

    @property
    def key(self) -> str:
        """Canonical text naming this constraint (the grammar compile cache key)."""
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name)},
                          sort_keys=True)

    @classmethod
    def coerce(cls, value: StructuredOutputsParams | dict[str, Any] | None) -> StructuredOutputsParams | None:
        """Accept an instance, a dict of its fields, or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in fields(cls)})
            if unknown:
                raise ValueError(f"unknown structured_outputs field(s): {', '.join(unknown)}")
            return cls(**value)
        raise SamplingParamsTypeError(f"structured_outputs must be a StructuredOutputsParams or a dict, "
                                      f"got {type(value).__name__}")


class RequestOutputKind(enum.IntEnum):
    """What a request's stream yields, as vLLM's enum of the same name (docs/python-api.md)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to sample one request's completions: vLLM's fields, each described in docs/python-api.md."""

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stream_interval: int = 1
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        self._check_types()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        self.validate()

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from a dict; unknown keys are a `ValueError` (not silently ignored)."""
        return cls(**values)

    def _check_types(self) -> None:
        """Wrong types are reported with the type's name (e.g. temperature='0.5' is a str)."""
        for names, is_valid, kind in _FIELD_TYPES:
            for name in names:
                value = getattr(self, name)
                if not is_valid(value):
                    raise SamplingParamsTypeError(f"{name} must be {kind}, got {type(value).__name__} {value!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsTypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise SamplingParamsTypeError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        if self.logit_bias is not None and (not isinstance(self.logit_bias, dict) or not all(
                _is_int(k) and _is_number(v) for k, v in self.logit_bias.items())):
            raise SamplingParamsTypeError("logit_bias must be a dict of token id (int) -> bias (number)")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise SamplingParamsTypeError(f"stop_token_ids must be a list of integers, got "
                                          f"{type(self.stop_token_ids).__name__}")

    def validate(self) -> None:
        """Raise `ValueError` with a clear message for any out-of-range field."""
        self._check_types()
        max_tokens = self.max_tokens
        checks = [
            (1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}], got {self.n!r}"),
            (max_tokens is None or max_tokens >= 1, f"max_tokens must be an integer >= 1 or None, got {max_tokens!r}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature!r}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (self.top_k == -1 or self.top_k >= 1, f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}"),
            (all(isinstance(s, str) and s for s in self.stop or ()), "stop must be a list of non-empty strings"),
            (all(_is_int(t) and t >= 0 for t in self.stop_token_ids or ()),
             "stop_token_ids must be non-negative integers"),
            (0 <= self.min_tokens <= (max_tokens if max_tokens is not None else self.min_tokens),
             f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty!r}"),
            (all(k >= 0 and -100 <= v <= 100 for k, v in (self.logit_bias or {}).items()),
             "logit_bias needs token ids >= 0 and biases in [-100, 100]"),
            (self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs must be a StructuredOutputsParams"),
            (isinstance(self.output_kind, RequestOutputKind),
             f"output_kind must be a RequestOutputKind, got {self.output_kind!r}"),
            (1 <= self.stream_interval <= MAX_STREAM_INTERVAL,
             f"stream_interval must be in [1, {MAX_STREAM_INTERVAL}], got {self.stream_interval!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _reject_unknown_fields(cls: type) -> None:
    """Make unknown keyword arguments a ValueError (the API's error for bad input) rather than
    the TypeError a dataclass constructor raises."""
    dataclass_init = getattr(cls, "__init__")  # mypy rejects `cls.__init__` on a class object
    known = {f.name for f in fields(cls)}

    @functools.wraps(dataclass_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        dataclass_init(self, *args, **kwargs)

    setattr(cls, "__init__", __init__)


_reject_unknown_fields(SamplingParams)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not (
        isinstance(value, float) and math.isnan(value))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_FIELD_TYPES: tuple[tuple[tuple[str, ...], Callable[[Any], bool], str], ...] = (
    (("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"),
     _is_number, "a number"),
    (("n", "top_k", "min_tokens", "stream_interval"), _is_int, "an integer"),
    (("max_tokens", "seed", "logprobs", "prompt_logprobs"), lambda value: value is None or _is_int(value),
     "an integer or None"),
)


def _check_type(name: str, value: Any, kinds: tuple[type, ...]) -> None:
    if not isinstance(value, kinds):
        raise SamplingParamsTypeError(f"{name} has the wrong type: {type(value).__name__}")


@dataclass
class CompletionOutput:
    """One completion of a request, cumulative (fields: docs/python-api.md)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        """True once this completion has a finish reason."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """State of one request after an engine step: its `n` completions in `outputs` (docs/python-api.md)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, float] | None] | None = None

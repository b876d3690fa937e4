"""`SamplingParams` (vLLM-shaped) and `RequestOutput`, the public request/response types."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class SamplingParams:
    """How to sample one request's completion.

    temperature 0 is greedy (deterministic). `seed` makes random sampling reproducible per
    request. `stop` strings end generation and are cut from the text; `stop_token_ids` end it
    on those tokens. `logprobs=k` returns, for every generated token, its log-probability and
    the top-k alternatives. `ignore_eos` keeps generating past EOS up to `max_tokens`.
    """

    max_tokens: int = 16
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        """Build from a dict; unknown keys are a `ValueError` (not silently ignored)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**values)

    def validate(self) -> None:
        """Raise `ValueError` with a clear message for any out-of-range field."""
        checks = [
            (isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (_is_number(self.temperature) and self.temperature >= 0,
             f"temperature must be >= 0, got {self.temperature!r}"),
            (_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
             f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}"),
            (_is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}"),
            (self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
             f"seed must be an integer, got {self.seed!r}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be non-negative integers"),
            (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             f"logprobs must be in [0, 20], got {self.logprobs!r}"),
            (_is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}"),
            (_is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"),
            (_is_number(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty!r}"),
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
    dataclass_init = cls.__init__
    known = {f.name for f in fields(cls)}

    @functools.wraps(dataclass_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        dataclass_init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]


_reject_unknown_fields(SamplingParams)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


@dataclass
class RequestOutput:
    """State of one request after an engine step (cumulative, not a delta).

    `token_ids`/`text` hold everything generated so far; `finished` is set once with
    `finish_reason` in {"stop", "length", "abort", "error"}. `num_cached_tokens` is the prompt
    prefix restored from the joint prefix cache (0 on a cold start). `logprobs[i]` maps token
    id -> log-probability for generated token i (the sampled token plus the top-k), when asked.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    metrics: dict[str, float] = field(default_factory=dict)

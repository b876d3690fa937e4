"""A request's lifetime state: tokens, sampling, progress and outputs (cache resources: the manager's)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridserve.engine.detokenizer import IncrementalDetokenizer
from hybridserve.sampling_params import SamplingParams

UNCAPPED_CHUNK = 1 << 62
# A request scoring its prompt (prompt_logprobs) keeps every prompt position's logits of a step:
# its prefill chunks are capped so those logits stay bounded (this many rows of the vocabulary).
PROMPT_LOGPROBS_CHUNK_TOKENS = 512


class RequestStatus(enum.Enum):
    """Where a request is: waiting for admission, running, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence of a `RequestGroup`: `num_computed_tokens` of `token_ids` (prompt + generated) are done."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    index: int = 0                             # completion index within its RequestGroup
    max_tokens: int = 16                       # params.max_tokens, resolved (None -> up to the context)
    matcher: Any = None                        # llguidance LLMatcher when structured outputs are asked
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    output_text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    first_token_time: float | None = None
    failed_steps: int = 0
    detokenizer: IncrementalDetokenizer | None = None
    keep_prompt_logits: bool = False           # diagnostics: keep logits of every computed position
    prompt_logits: list[torch.Tensor] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: None for the first prompt token, then one row per prompt token
    # scored so far (the first sequence of a group only: its siblings fork from its prompt)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    max_chunk_tokens: int = UNCAPPED_CHUNK     # the most tokens the scheduler puts in one chunk of it

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.index == 0:
            self.prompt_logprobs = [None]
            self.max_chunk_tokens = PROMPT_LOGPROBS_CHUNK_TOKENS

    @property
    def num_prompt_logprobs_missing(self) -> int:
        """Prompt tokens still to be scored for `prompt_logprobs` (0 when none were asked)."""
        if self.prompt_logprobs is None:
            return 0
        return self.num_prompt_tokens - len(self.prompt_logprobs)

    @property
    def skips_prefix_cache(self) -> bool:
        """The prefix cache must not restore this sequence: its prompt logprobs need the logits of
        every prompt position, and a restored prefix has none (vLLM skips the cache for them too)."""
        return self.num_prompt_logprobs_missing > 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)


@dataclass(eq=False)
class RequestGroup:
    """The `n` sequences of one request: sequence 0 prefills the prompt, the others wait in `unforked`
    until they are forked from it (docs/prefix-cache.md, Forks)."""

    request_id: str
    sequences: list[Request]
    unforked: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.unforked = list(self.sequences[1:])

    @property
    def first(self) -> Request:
        return self.sequences[0]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.sequences)

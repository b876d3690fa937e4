"""A request's lifetime state: tokens, progress, and the cache resources it owns."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridserve.cache.block_pool import BlockHash, block_hashes_for, hash_tail
from hybridserve.engine.detokenizer import IncrementalDetokenizer
from hybridserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is: waiting for admission, running, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request. Owns `block_ids` (one reference each) and `state_slot` while running.

    Progress is `num_computed_tokens` of `token_ids` (prompt + generated). A step computes
    tokens [num_computed_tokens, num_computed_tokens + n); when it reaches the end, the next token
    is sampled and appended. After preemption the request recomputes from the start (or from the
    prefix cache), over the prompt and everything generated so far.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    block_size: int
    cache_salt: str | None = None
    block_hash: str = "xxh3_128"                # hash algorithm of its KV blocks (cache.block_hash)
    index: int = 0                             # completion index within its RequestGroup
    max_tokens: int = 16                       # params.max_tokens, resolved (None -> up to the context)
    matcher: Any = None                        # llguidance LLMatcher when structured outputs are asked
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    state_slot: int | None = None
    num_cached_tokens: int | None = None
    branch_point: int = 0                      # KV matched this deep at admission, with no snapshot there
    snapshot_depth: int = 0                    # deepest snapshot on this request's path (restored or taken)
    snapshot_key: BlockHash | None = None      # ... and its key (the parent of the next one taken)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    output_text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    first_token_time: float | None = None
    failed_steps: int = 0
    prefix_lookup_counted: bool = False         # its admission is in the prefix-cache stats
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    keep_prompt_logits: bool = False           # diagnostics: keep logits of every computed position
    prompt_logits: list[torch.Tensor] = field(default_factory=list)
    _block_hashes: list[BlockHash] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

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

    @property
    def extra_keys(self) -> tuple:
        """Hash extra keys: requests with different salts share no cache entry."""
        return () if self.cache_salt is None else (self.cache_salt,)

    def block_hashes(self, num_blocks: int) -> list[BlockHash]:
        """Hashes of the first `num_blocks` full blocks of `token_ids` (computed incrementally)."""
        if num_blocks > len(self._block_hashes):
            upto = self.token_ids[: num_blocks * self.block_size]
            self._block_hashes = block_hashes_for(upto, self.block_size, self.extra_keys, start=self._block_hashes,
                                                  algorithm=self.block_hash)
        return self._block_hashes[:num_blocks]

    def boundary_key(self, num_tokens: int) -> BlockHash:
        """Name of the prefix `token_ids[:num_tokens]`: its last full block's hash, or the tail
        hash of the partial block when the boundary falls inside a block."""
        full, partial = divmod(num_tokens, self.block_size)
        hashes = self.block_hashes(full)
        if partial == 0:
            return hashes[-1]
        parent = hashes[-1] if hashes else None
        return hash_tail(parent, self.token_ids[full * self.block_size:num_tokens], self.extra_keys, self.block_hash)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)


@dataclass(eq=False)
class RequestGroup:
    """The `n` sequences of one request. Sequence 0 prefills the prompt; the others wait in
    `unforked` and are forked from it (sharing its KV blocks and copying its GDN state) when its
    prefill completes, so the prompt is computed once."""

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

"""Token sampling: grammar masks, greedy, temperature / top-k / top-p / min-p, penalties, per-request
seeds, logprobs."""

from __future__ import annotations

from typing import NamedTuple

import torch

from hybridserve.engine.request import Request
from hybridserve.engine.structured_output import TokenMasker


class SampleResult(NamedTuple):
    """Chosen token per row and, for rows that asked, {token: logprob} of it plus the top-k."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


def sample(logits: torch.Tensor, requests: list[Request], masker: TokenMasker | None = None) -> SampleResult:
    """Sample one token for each row of `logits` ([R, vocab], float32), row i for requests[i].

    Rows of requests with a grammar matcher are masked first (one batched mask for all of them);
    logprobs are those of the model's distribution, before masks and penalties."""
    if not requests:
        return SampleResult([], [])
    processed = logits
    constrained = [row for row, r in enumerate(requests) if r.matcher is not None]
    if constrained:
        assert masker is not None, "a request has a grammar matcher but the engine has no masker"
        processed = logits.clone()
        masker.apply(processed, constrained, [requests[row].matcher for row in constrained])
    biased = [row for row, r in enumerate(requests) if r.params.logit_bias]
    if biased:
        processed = processed.clone() if processed is logits else processed
        for row in biased:
            bias = requests[row].params.logit_bias or {}
            ids = torch.tensor([t for t in bias if t < processed.shape[-1]], dtype=torch.long, device=processed.device)
            values = torch.tensor([v for t, v in bias.items() if t < processed.shape[-1]], device=processed.device)
            processed[row].index_add_(0, ids, values.to(processed.dtype))
    if any(r.params.needs_penalties for r in requests):
        processed = processed.clone() if processed is logits else processed
        for row, request in enumerate(requests):
            if request.params.needs_penalties:
                _apply_penalties(processed[row], request)
    greedy = processed.argmax(dim=-1).tolist()
    tokens = [greedy[row] if r.params.greedy else _sample_row(processed[row], r)
              for row, r in enumerate(requests)]
    logprobs: list[dict[int, float] | None] = [None] * len(requests)
    wanted = [row for row, r in enumerate(requests) if r.params.logprobs is not None]
    if wanted:
        all_logprobs = torch.log_softmax(logits[wanted], dim=-1)
        for index, row in enumerate(wanted):
            logprobs[row] = _top_logprobs(all_logprobs[index], tokens[row], requests[row].params.logprobs or 0)
    return SampleResult(tokens, logprobs)


def _top_logprobs(row_logprobs: torch.Tensor, chosen: int, top: int) -> dict[int, float]:
    result = {chosen: float(row_logprobs[chosen])}
    if top > 0:
        values, ids = row_logprobs.topk(top)
        for token, value in zip(ids.tolist(), values.tolist()):
            result.setdefault(token, value)
    return result


def _apply_penalties(row: torch.Tensor, request: Request) -> None:
    """OpenAI presence/frequency penalties over generated tokens, and the multiplicative
    repetition penalty over prompt + generated tokens (in place)."""
    params = request.params
    if params.repetition_penalty != 1.0 and request.token_ids:
        seen = torch.tensor(sorted(set(request.token_ids)), device=row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and request.output_token_ids:
        ids, counts = torch.tensor(request.output_token_ids, device=row.device).unique(return_counts=True)
        row[ids] -= params.frequency_penalty * counts.to(row.dtype) + params.presence_penalty


def _sample_row(row: torch.Tensor, request: Request) -> int:
    params = request.params
    scores = row / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = scores.topk(params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(-1)
        drop = cumulative - sorted_probs > params.top_p * cumulative[-1]
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=request.generator))

"""Token sampling: grammar masks, logit bias, greedy, temperature / top-k / top-p / min-p,
penalties, per-request seeds, logprobs — with failures isolated per request."""

from __future__ import annotations

from typing import NamedTuple

import torch

from hybridserve.engine.request import Request
from hybridserve.engine.structured_output import TokenMasker
from hybridserve.layers import native


class SampleResult(NamedTuple):
    """Chosen token per row and, for rows that asked, {token: logprob} of it plus the top-k."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


class SampledToken(NamedTuple):
    """One request's sampled token and (if it asked) its logprobs."""

    token_id: int
    logprobs: dict[int, float] | None


class NonFiniteLogitsError(FloatingPointError):
    """A request's logits contain NaN or infinity: nothing meaningful can be sampled."""


def sample_isolated(logits: torch.Tensor, requests: list[Request],
                    masker: TokenMasker | None = None) -> list[SampledToken | Exception]:
    """Sample one token for each row of `logits` ([R, vocab], float32), row i for requests[i],
    isolating failures: a row with non-finite logits, or whose mask, bias, penalties, sampling or
    logprobs raise, yields its exception; the other rows are sampled exactly as they would be
    alone (each random draw happens once, from the request's own generator).

    Rows of requests with a grammar matcher are masked first (one batched mask for all of them);
    logprobs are those of the model's distribution, before masks, bias and penalties."""
    if not requests:
        return []
    summary = native.argmax_and_finite(logits)
    finite = summary[1] if summary is not None else torch.isfinite(logits).all(dim=-1).tolist()
    if summary is not None and all(finite) and all(_plain_greedy(request) for request in requests):
        return [SampledToken(token, None) for token in summary[0]]  # the common decode step, at once
    results: list[SampledToken | Exception] = [
        NonFiniteLogitsError("the model produced non-finite logits") for _ in requests]
    healthy = [row for row, ok in enumerate(finite) if ok]
    processed = logits
    constrained = [row for row in healthy if requests[row].matcher is not None]
    if constrained:
        assert masker is not None, "a request has a grammar matcher but the engine has no masker"
        processed = logits.clone()
        try:
            masker.apply(processed, constrained, [requests[row].matcher for row in constrained])
        except Exception as exc:  # noqa: BLE001 - the grammar rows fail, the others go on
            for row in constrained:
                results[row] = exc
                healthy.remove(row)
    for row in list(healthy):
        request = requests[row]
        if not (request.params.logit_bias or request.params.needs_penalties):
            continue
        processed = processed.clone() if processed is logits else processed
        try:
            _apply_bias(processed[row], request)
            if request.params.needs_penalties:
                _apply_penalties(processed[row], request)
        except Exception as exc:  # noqa: BLE001 - this request's failure only
            results[row] = exc
            healthy.remove(row)
    greedy = summary[0] if summary is not None and processed is logits else processed.argmax(dim=-1).tolist()
    wanted = [row for row in healthy if requests[row].params.logprobs is not None]
    all_logprobs = torch.log_softmax(logits[wanted], dim=-1) if wanted else None
    for row in healthy:
        request = requests[row]
        try:
            token = greedy[row] if request.params.greedy else _sample_row(processed[row], request)
            logprobs = None
            if all_logprobs is not None and row in wanted:
                logprobs = _top_logprobs(all_logprobs[wanted.index(row)], token, request.params.logprobs or 0)
            results[row] = SampledToken(token, logprobs)
        except Exception as exc:  # noqa: BLE001 - this request's failure only
            results[row] = exc
    return results


def _plain_greedy(request: Request) -> bool:
    """Greedy, with nothing to apply to its logits and no logprobs: its token is the row's argmax."""
    params = request.params
    return (params.temperature == 0 and request.matcher is None and not params.logit_bias
            and not params.needs_penalties and params.logprobs is None)


def sample(logits: torch.Tensor, requests: list[Request], masker: TokenMasker | None = None) -> SampleResult:
    """Sample one token for each row; raises the first row's failure (see `sample_isolated`)."""
    results = sample_isolated(logits, requests, masker)
    for result in results:
        if isinstance(result, Exception):
            raise result
    tokens = [r.token_id for r in results if isinstance(r, SampledToken)]
    return SampleResult(tokens, [r.logprobs for r in results if isinstance(r, SampledToken)])


def _apply_bias(row: torch.Tensor, request: Request) -> None:
    """OpenAI logit_bias: add each listed token's bias (ids were checked against the vocabulary)."""
    bias = request.params.logit_bias
    if not bias:
        return
    ids = torch.tensor([t for t in bias if t < row.shape[-1]], dtype=torch.long, device=row.device)
    values = torch.tensor([v for t, v in bias.items() if t < row.shape[-1]], device=row.device)
    row.index_add_(0, ids, values.to(row.dtype))


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

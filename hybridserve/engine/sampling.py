"""Token sampling where the logits are (masks, bias, penalties, top-k/p, min-p, seeds, logprobs;
failures isolated per row): the engine plans each draw as a picklable `SamplingSpec`, the worker
holding the logits samples it with its `Sampler`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import torch

from hybridserve.engine.request import Request
from hybridserve.engine.structured_output import apply_bitmask
from hybridserve.layers import native

SequenceKey = tuple[str, int]  # (request id, completion index)


class SamplingSpec(NamedTuple):
    """One draw from one logits row: the sequence it is for and how to sample it."""

    key: SequenceKey
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None                   # the sequence's own generator (seed + index), else the shared one
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    token_ids: tuple[int, ...] = ()           # prompt + output, for the repetition penalty
    output_token_ids: tuple[int, ...] = ()    # for the presence and frequency penalties
    bitmask: np.ndarray | None = None         # packed int32 allowed-token bits (structured outputs)
    error: str | None = None                  # the engine could not prepare this draw (e.g. its grammar failed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing applied to its logits and no logprobs: its token is the row's argmax."""
        return (self.greedy and self.bitmask is None and not self.logit_bias and not self.needs_penalties
                and self.logprobs is None and self.error is None)


class PromptLogprobsSpec(NamedTuple):
    """Which positions of a prefill chunk score the prompt token that follows each (`prompt_logprobs`)."""

    first: int                 # offset in the chunk of the first scored position
    targets: tuple[int, ...]   # the prompt token each scored position predicts, in order
    top: int                   # alternatives per position besides the target


def prompt_logprobs_spec(request: Request, start: int, length: int) -> PromptLogprobsSpec | None:
    """The prompt tokens a chunk of `request` over [start, start + length) scores: those not scored
    yet whose predecessor lies in the chunk (None: nothing to score, or none were asked)."""
    scored = request.prompt_logprobs
    top = request.params.prompt_logprobs
    if scored is None or top is None:
        return None
    first = max(start, len(scored) - 1)       # position whose logits score prompt token first + 1
    end = min(start + length, request.num_prompt_tokens - 1)
    if first >= end:
        return None
    return PromptLogprobsSpec(first - start, tuple(request.prompt_token_ids[first + 1:end + 1]), top)


def score_prompt(logits: torch.Tensor, spec: PromptLogprobsSpec) -> list[dict[int, float]]:
    """Per row of `logits` ([len(spec.targets), vocab]), the target's log-probability and the top-k
    alternatives, from the raw logits (as generated tokens' logprobs are)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(spec.targets, dtype=torch.long, device=logits.device)
    own = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    rows = [{target: value} for target, value in zip(spec.targets, own)]
    if spec.top > 0:
        values, ids = logprobs.topk(spec.top, dim=-1)
        for row, row_ids, row_values in zip(rows, ids.tolist(), values.tolist()):
            for token, value in zip(row_ids, row_values):
                row.setdefault(token, value)
    return rows


def sampling_spec(request: Request, bitmask: np.ndarray | None = None, error: str | None = None) -> SamplingSpec:
    """The spec of `request`'s next draw (token history only when its penalties need it)."""
    params = request.params
    repetition = params.repetition_penalty != 1.0
    counted = params.presence_penalty != 0 or params.frequency_penalty != 0
    return SamplingSpec(
        (request.request_id, request.index), params.temperature, params.top_p, params.top_k, params.min_p,
        None if params.seed is None else params.seed + request.index, params.logprobs, params.logit_bias or None,
        params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
        tuple(request.token_ids) if repetition else (), tuple(request.output_token_ids) if counted else (),
        bitmask, error)


class SampledToken(NamedTuple):
    """One sequence's sampled token and (if it asked) its logprobs."""

    token_id: int
    logprobs: dict[int, float] | None


class NonFiniteLogitsError(FloatingPointError):
    """A row's logits contain NaN or infinity: nothing meaningful can be sampled."""


class SamplingError(RuntimeError):
    """A draw failed where the logits are; its message comes from the worker."""


class Sampler:
    """Worker-side sampling state: each seeded sequence's generator, and one shared by unseeded ones."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.shared = torch.Generator(device=device).manual_seed(seed)
        self._generators: dict[SequenceKey, torch.Generator] = {}

    def release(self, keys: Iterable[SequenceKey]) -> None:
        """Forget finished sequences' generators (a later sequence with the same key starts afresh)."""
        for key in keys:
            self._generators.pop(key, None)

    def generator(self, spec: SamplingSpec) -> torch.Generator:
        if spec.seed is None:
            return self.shared
        generator = self._generators.get(spec.key)
        if generator is None:
            generator = self._generators[spec.key] = torch.Generator(device=self.device).manual_seed(spec.seed)
        return generator

    def sample(self, logits: torch.Tensor, rows: list[int], specs: list[SamplingSpec]) -> list[SampledToken | str]:
        """Draw `specs[i]` from `logits[rows[i]]` ([R, vocab] float32); a failed draw (non-finite logits,
        or anything raising) yields its error message. Logprobs are taken before masks, bias and penalties."""
        if not specs:
            return []
        summary = native.argmax_and_finite(logits)
        finite = summary[1] if summary is not None else torch.isfinite(logits).all(dim=-1).tolist()
        if summary is not None and all(finite) and all(spec.plain_greedy for spec in specs):
            return [SampledToken(summary[0][row], None) for row in rows]  # the common decode step, at once
        results: list[SampledToken | str] = []
        for row, spec in zip(rows, specs):
            try:
                if spec.error is not None:
                    raise SamplingError(spec.error)
                if not finite[row]:
                    raise NonFiniteLogitsError("the model produced non-finite logits")
                results.append(_draw(logits[row], spec, self, summary[0][row] if summary is not None else None))
            except Exception as exc:  # noqa: BLE001 - this draw's failure only
                results.append(f"{type(exc).__name__}: {exc}")
        return results


def _draw(row: torch.Tensor, spec: SamplingSpec, sampler: Sampler, argmax: int | None) -> SampledToken:
    """One draw from one row of logits (the row itself is never modified)."""
    processed = row
    if spec.bitmask is not None or spec.logit_bias or spec.needs_penalties:
        processed = row.clone()
        if spec.bitmask is not None:
            apply_bitmask(processed.unsqueeze(0), spec.bitmask.reshape(1, -1))
        _apply_bias(processed, spec)
        if spec.needs_penalties:
            _apply_penalties(processed, spec)
    if spec.greedy:
        token = argmax if processed is row and argmax is not None else int(processed.argmax())
    else:
        token = _sample_row(processed, spec, sampler.generator(spec))
    logprobs = None
    if spec.logprobs is not None:
        logprobs = _top_logprobs(torch.log_softmax(row, dim=-1), token, spec.logprobs)
    return SampledToken(token, logprobs)


def _apply_bias(row: torch.Tensor, spec: SamplingSpec) -> None:
    """OpenAI logit_bias: add each listed token's bias (ids were checked against the vocabulary)."""
    bias = spec.logit_bias
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


def _apply_penalties(row: torch.Tensor, spec: SamplingSpec) -> None:
    """Presence/frequency penalties over generated tokens, repetition penalty over all (in place)."""
    if spec.repetition_penalty != 1.0 and spec.token_ids:
        seen = torch.tensor(sorted(set(spec.token_ids)), device=row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / spec.repetition_penalty, values * spec.repetition_penalty)
    if (spec.presence_penalty or spec.frequency_penalty) and spec.output_token_ids:
        counted = Counter(spec.output_token_ids)
        ids = torch.tensor(list(counted), device=row.device)
        counts = torch.tensor(list(counted.values()), dtype=row.dtype, device=row.device)
        row[ids] -= spec.frequency_penalty * counts + spec.presence_penalty


def _sample_row(row: torch.Tensor, spec: SamplingSpec, generator: torch.Generator) -> int:
    scores = row / spec.temperature
    if spec.top_k > 0 and spec.top_k < scores.shape[-1]:
        kth = scores.topk(spec.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if spec.min_p > 0:
        probs = probs.masked_fill(probs < spec.min_p * probs.max(), 0.0)
    if spec.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(-1)
        drop = cumulative - sorted_probs > spec.top_p * cumulative[-1]
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))

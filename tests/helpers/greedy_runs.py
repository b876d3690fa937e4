"""Run prompts to completion on an `LLMEngine` with greedy sampling, for tests that compare two
engine configurations token for token."""

from __future__ import annotations

from typing import NamedTuple

from hybridserve import SamplingParams
from hybridserve.engine.engine import LLMEngine


class GreedyRun(NamedTuple):
    """One finished request: its tokens, how many prompt tokens came from the cache, and the
    per-token top log-probabilities (None unless asked for)."""

    token_ids: tuple[int, ...]
    num_cached_tokens: int
    logprobs: list | None


def run_greedy(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int = 24,
               logprobs: int | None = None) -> dict[str, GreedyRun]:
    """Add every prompt, step until all finish, check the engine's integrity; results by request id."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    done: dict[str, GreedyRun] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                completion = output.outputs[0]
                done[output.request_id] = GreedyRun(tuple(completion.token_ids), output.num_cached_tokens,
                                                    completion.logprobs)
    engine.check_integrity()
    return done

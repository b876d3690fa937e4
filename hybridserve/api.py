"""`LLM`: the offline Python API in the vLLM shape."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hybridserve.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridserve.engine.engine import LLMEngine, PrefixCacheReport
from hybridserve.engine.memory_plan import parse_size
from hybridserve.sampling_params import RequestOutput, SamplingParams

Prompt = str | list[int]


class LLM:
    """Load a model (or the built-in one) and generate completions for batches of prompts.

    >>> llm = LLM()
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0.0))[0]
    """

    def __init__(self, model: str | None = None, *, device: str = "auto", dtype: str = "auto", seed: int = 0,
                 block_size: int = 16, kv_cache_mib: float | None = None, prefix_cache_mib: float | None = None,
                 snapshot_interval: int = 256, cache_policy: str = "hybridserve", max_num_seqs: int = 32, max_num_batched_tokens: int = 8192,
                 max_model_len: int | None = None, max_prefill_tokens_during_decode: int = 32,
                 memory_fraction: float | None = None, kv_cache_memory: int | str | None = None,
                 snapshot_memory_share: float = 0.5, block_hash: str = "xxh3_128",
                 num_threads: int | None = None) -> None:
        memory = parse_size(str(kv_cache_memory)) if kv_cache_memory is not None else None
        cache = CacheConfig(block_size=block_size, kv_cache_mib=kv_cache_mib, prefix_cache_mib=prefix_cache_mib,
                            snapshot_interval=snapshot_interval, kv_cache_memory_bytes=memory,
                            memory_fraction=memory_fraction, snapshot_memory_share=snapshot_memory_share,
                            block_hash=block_hash, cache_policy=cache_policy)
        scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                    max_model_len=max_model_len,
                                    max_prefill_tokens_during_decode=max_prefill_tokens_during_decode)
        self.llm_engine = LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, seed=seed,
                                                 num_threads=num_threads, cache=cache, scheduler=scheduler))
        self._ids = itertools.count()

    @property
    def tokenizer(self):  # noqa: ANN201 - hybridserve.models.tokenizer.Tokenizer
        return self.llm_engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, *, cache_salt: str | None = None) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of token ids, or a list of either) and
        return the finished outputs in input order. All prompts are validated before any runs."""
        batch = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(batch))
        engine = self.llm_engine
        requests = [engine.make_request(f"llm-{next(self._ids)}", prompt, param, cache_salt)
                    for prompt, param in zip(batch, params)]
        for request in requests:
            engine.enqueue(request)
        finished: dict[str, RequestOutput] = {}
        try:
            while len(finished) < len(requests):
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
        finally:
            for request in requests:
                if request.request_id not in finished:
                    engine.abort_request(request.request_id)
        return [finished[r.request_id] for r in requests]

    def prefix_cache_stats(self) -> PrefixCacheReport:
        """Joint prefix cache counters: queries, hits, misses by kind, snapshot residency."""
        return self.llm_engine.prefix_cache_stats()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one tokenized prompt
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a string, a list of token ids, or a non-empty list of those")
    return list(prompts)


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return params

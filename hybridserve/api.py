"""`LLM`: the offline Python API in the vLLM shape (`generate`, `chat`, `get_tokenizer`)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from hybridserve.cache.tiers import TierStats
from hybridserve.config import CacheConfig, EngineConfig, SchedulerConfig, parse_size
from hybridserve.engine.engine import LLMEngine, PrefixCacheReport
from hybridserve.models.tokenizer import Tokenizer
from hybridserve.sampling_params import RequestOutput, SamplingParams
from hybridserve.server.chat import ChatRenderer

Prompt = str | list[int]
Message = Mapping[str, Any]
TQDM_MIN_PROMPTS = 2


class LLM:
    """Load a model (or the built-in one) and generate completions for batches of prompts.

    >>> llm = LLM()
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0.0))[0]
    >>> out.outputs[0].text
    """

    def __init__(self, model: str | None = None, *, device: str = "auto", dtype: str = "auto", seed: int = 0,
                 block_size: int = 16, kv_cache_mib: float | None = None, prefix_cache_mib: float | None = None,
                 snapshot_interval: int = 256, cache_policy: str = "hybridserve", max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 8192,
                 max_model_len: int | None = None,
                 max_prefill_tokens_during_decode: int = SchedulerConfig.max_prefill_tokens_during_decode,
                 memory_fraction: float | None = None, kv_cache_memory: int | str | None = None,
                 snapshot_memory_share: float = 0.5, block_hash: str = "xxh3_128",
                 num_threads: int | None = None, quantization: str | None = None,
                 tensor_parallel_size: int = 1, host_cache_memory: int | str | None = None,
                 disk_cache_dir: str | None = None, disk_cache_size: int | str | None = None,
                 tier_write_policy: str = "write-through", remote_cache_url: str | None = None,
                 block_hash_seed: int | None = None) -> None:
        memory = parse_size(str(kv_cache_memory)) if kv_cache_memory is not None else None
        cache = CacheConfig(block_size=block_size, kv_cache_mib=kv_cache_mib, prefix_cache_mib=prefix_cache_mib,
                            snapshot_interval=snapshot_interval, kv_cache_memory_bytes=memory,
                            memory_fraction=memory_fraction, snapshot_memory_share=snapshot_memory_share,
                            block_hash=block_hash, block_hash_seed=block_hash_seed, cache_policy=cache_policy,
                            host_cache_memory_bytes=parse_size(str(host_cache_memory)) if host_cache_memory else 0,
                            disk_cache_dir=disk_cache_dir,
                            disk_cache_size_bytes=parse_size(str(disk_cache_size)) if disk_cache_size else None,
                            tier_write_policy=tier_write_policy, remote_cache_url=remote_cache_url)
        scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                    max_model_len=max_model_len,
                                    max_prefill_tokens_during_decode=max_prefill_tokens_during_decode)
        self._attach(LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, seed=seed,
                                            num_threads=num_threads, quantization=quantization,
                                            tensor_parallel_size=tensor_parallel_size, cache=cache,
                                            scheduler=scheduler)))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An `LLM` on an engine built from a full `EngineConfig` (e.g. from command-line flags)."""
        llm = cls.__new__(cls)
        llm._attach(LLMEngine(config))
        return llm

    def _attach(self, engine: LLMEngine) -> None:
        self.llm_engine = engine
        self._chat = ChatRenderer(engine.tokenizer.chat_template)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (same as `get_tokenizer()`)."""
        return self.llm_engine.tokenizer

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer: `encode`, `decode`, `apply_chat_template`, `eos_token_ids`."""
        return self.llm_engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, *, cache_salt: str | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """The finished `RequestOutput`s of every prompt, in input order (docs/python-api.md); all prompts are
        validated before any runs."""
        batch = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(batch))
        engine = self.llm_engine
        groups = [engine.make_request(f"llm-{next(self._ids)}", prompt, param, cache_salt)
                  for prompt, param in zip(batch, params)]
        engine.await_grammars(groups)  # a bad or too slow grammar is a ValueError before any prompt runs
        for group in groups:
            engine.enqueue(group)
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(groups), desc="Processed prompts", unit="prompt",
                        disable=not use_tqdm or len(groups) < TQDM_MIN_PROMPTS)
        try:
            while len(finished) < len(groups):
                for output in engine.step(final_only=True):
                    finished[output.request_id] = output
                    progress.update(1)
        finally:
            progress.close()
            for group in groups:
                if group.request_id not in finished:
                    engine.abort_request(group.request_id)
        return [finished[g.request_id] for g in groups]

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             chat_template_kwargs: Mapping[str, Any] | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
             add_generation_prompt: bool = True, cache_salt: str | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Render one conversation or a list of them with the model's chat template and generate a reply to
        each (docs/python-api.md)."""
        conversations = _as_conversations(messages)
        prompts = [self.render_chat(conversation, tools=tools, chat_template_kwargs=chat_template_kwargs,
                                    add_generation_prompt=add_generation_prompt)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, cache_salt=cache_salt, use_tqdm=use_tqdm)

    def render_chat(self, messages: Sequence[Message], *, tools: Sequence[Mapping[str, Any]] | None = None,
                    chat_template_kwargs: Mapping[str, Any] | None = None,
                    add_generation_prompt: bool = True) -> str:
        """The prompt text the chat template makes of `messages` (ValueError if it cannot)."""
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise ValueError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        if tools is not None and not isinstance(tools, (list, tuple)):
            raise ValueError(f"tools must be a list, got {type(tools).__name__}")
        return self._chat.render([dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                                 extra=dict(chat_template_kwargs or {}), tools=list(tools) if tools else None)

    def prefix_cache_stats(self) -> PrefixCacheReport:
        """Joint prefix cache counters: queries, hits, misses by kind, snapshot residency."""
        return self.llm_engine.prefix_cache_stats()

    def tier_stats(self) -> list[TierStats]:
        """Per cache tier (the device first, then host and disk when on), its `TierStats`."""
        return self.llm_engine.tier_stats()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_tiers: bool = False) -> bool:
        """Forget every cached prefix (the device's; with `reset_tiers` the host and disk tiers' too),
        so the next prompts compute whole; False, changing nothing, while requests run (unless
        `reset_running_requests`). See `LLMEngine.reset_prefix_cache`."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests, reset_tiers)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one tokenized prompt
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a string, a list of token ids, or a non-empty list of those; "
                         f"got {type(prompts).__name__}")
    return list(prompts)


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    if not isinstance(params, (list, tuple)):
        raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {type(params).__name__}")
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    bad = next((p for p in params if not isinstance(p, SamplingParams)), None)
    if bad is not None:
        raise ValueError(f"sampling_params must hold SamplingParams, got {type(bad).__name__}")
    return params


def _as_conversations(messages: Sequence[Message] | Sequence[Sequence[Message]]) -> list[list[Message]]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of messages or of conversations, "
                         f"got {type(messages).__name__}")
    conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
    for conversation in conversations:
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise ValueError("each conversation must be a non-empty list of messages")
        for message in conversation:
            if not isinstance(message, Mapping) or "role" not in message:
                raise ValueError(f"a message must be a dict with a 'role', got {message!r}")
    return [list(c) for c in conversations]

"""Prefix-cache test pieces shared by the default, slow and CUDA suites: an `LLM` builder for the
interval policy, deterministic prompts, a multi-turn workload, and the cache-on == cache-off
differential checks."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from hybridserve import LLM, SamplingParams
from hybridserve.config import POLICY_NAMES
from tests.helpers.targets import CPU


def random_tokens(length: int, seed: int) -> list[int]:
    """`length` deterministic token ids of the built-in vocabulary."""
    return torch.randint(0, 4096, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def cache_llm(path: Path, **kwargs: Any) -> LLM:
    """An `LLM` on `path` with the interval policy and a 16 MiB KV pool unless `kwargs` say otherwise;
    these scenarios pin down the interval policy's boundaries (tests/cache/test_cache_policy.py
    covers the rest)."""
    kwargs.setdefault("kv_cache_mib", 16)
    kwargs.setdefault("cache_policy", "interval")
    kwargs.setdefault("device", CPU.device)
    kwargs.setdefault("dtype", CPU.dtype)
    return LLM(model=str(path), **kwargs)


def snapshot_mib(llm: LLM, slots: int) -> float:
    """A prefix-cache size in MiB that holds exactly `slots` GDN snapshots of `llm`'s model."""
    return (slots + 0.5) * llm.llm_engine.bytes_per_snapshot / (1 << 20)


def assert_idle(llm: LLM) -> None:
    """The engine is consistent and every KV block and state slot is free."""
    llm.llm_engine.check_integrity()
    pool = llm.llm_engine.cache.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    slots = llm.llm_engine.cache.state_slots
    assert slots.num_free_slots == slots.num_slots


def multi_turn_workload(seed: int) -> list[list[list[int]]]:
    """Rounds of prompts: shared system prompts, conversations extending earlier turns."""
    rng = random.Random(seed)
    systems = [random_tokens(rng.randint(40, 200), seed=1000 + i) for i in range(3)]
    conversations = [list(rng.choice(systems)) for _ in range(6)]
    rounds = []
    for turn in range(4):
        batch = []
        for index, history in enumerate(conversations):
            if rng.random() < 0.8:
                history.extend(random_tokens(rng.randint(5, 90), seed=seed * 100 + turn * 10 + index))
                batch.append(list(history))
        rounds.append(batch)
    return rounds


def check_random_configuration(checkpoint: Path, seed: int) -> None:
    """Cache on equals cache off for the multi-turn workload of `seed` under a configuration drawn
    from it (policy, chunk budget, running sequences, interval, pool sizes, output length); pools
    consistent after every round and idle at the end. Several sequences of a step share prefixes,
    so one step's captures may name each other as parents."""
    rng = random.Random(seed)
    budget, policy = rng.choice([16, 37, 64, 160, 300, 512]), rng.choice(POLICY_NAMES)
    seqs, interval = rng.choice([1, 2, 4, 8]), rng.choice([16, 32, 64])
    slots, kv_blocks, max_tokens = rng.choice([3, 6, 12, 40]), rng.choice([200, 400, 2000]), rng.choice([1, 6, 20])
    probe = cache_llm(checkpoint, prefix_cache_mib=0)
    on = cache_llm(checkpoint, snapshot_interval=interval, prefix_cache_mib=snapshot_mib(probe, slots),
                   kv_cache_mib=kv_blocks * 4 / 1024, max_num_batched_tokens=budget, max_num_seqs=seqs,
                   cache_policy=policy)
    off = cache_llm(checkpoint, prefix_cache_mib=0, max_num_batched_tokens=1024)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for batch in multi_turn_workload(seed):
        out_on = on.generate(batch, params, use_tqdm=False)
        out_off = off.generate(batch, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out_on] == [o.outputs[0].token_ids for o in out_off], \
            (policy, budget, seqs, interval, slots, kv_blocks)
        on.llm_engine.check_integrity()
    assert_idle(on)


def check_multi_turn_cache_on_equals_off(checkpoint: Path, seed: int) -> None:
    """The multi-turn workload of `seed` through a small cache (12 snapshot slots, 200 KV blocks,
    4 sequences, 160-token chunks) gives the same greedy tokens as the cache off, with hits and
    evictions along the way."""
    probe = cache_llm(checkpoint, prefix_cache_mib=0)
    on = cache_llm(checkpoint, snapshot_interval=32, prefix_cache_mib=snapshot_mib(probe, 12),
                   kv_cache_mib=200 * 4 / 1024, max_num_batched_tokens=160, max_num_seqs=4)
    off = cache_llm(checkpoint, prefix_cache_mib=0, max_num_batched_tokens=1024)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for batch in multi_turn_workload(seed):
        out_on = on.generate(batch, params)
        out_off = off.generate(batch, params)
        assert [o.outputs[0].token_ids for o in out_on] == [o.outputs[0].token_ids for o in out_off]
        on.llm_engine.check_integrity()
    stats = on.prefix_cache_stats()
    assert stats.hits > 0 and stats.snapshots_evicted > 0
    assert_idle(on)

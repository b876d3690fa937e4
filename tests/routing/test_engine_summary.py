"""A real engine's routing summary, read by a JointIndex, predicts exactly the `cached_tokens` the
engine then reports (device snapshots and the host tier), and another tenant's prompt gets depth 0."""

from __future__ import annotations

import json
import time

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.routing.index import JointIndex
from tests.helpers.targets import CPU

PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def _tokens(length: int, seed: int) -> list[int]:
    return torch.randint(0, 4000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _predict_and_run(llm: LLM, index: JointIndex, epoch: int, prompt: list[int],
                     salt: str | None = None) -> tuple[int, int, list[int]]:
    """(predicted depth, reported cached tokens, output tokens) of one request after a fresh summary."""
    engine = llm.llm_engine
    # a tier entry is published once its write has landed: settle writes in flight first, so the
    # summary and the admission see the same entries (a live router sees late ones a summary later)
    deadline = time.monotonic() + 30
    while engine.tier_mover is not None and engine.tier_mover.busy and time.monotonic() < deadline:
        engine.tier_mover.wait(0.5)
        engine.cache.poll_tiers()
    summary = json.loads(json.dumps(engine.routing_summary(epoch)))  # as it crosses a process boundary
    assert index.update("replica", summary)
    predicted = index.depths(prompt, salt)["replica"]
    out = llm.generate([prompt], PARAMS, cache_salt=salt, use_tqdm=False)[0]
    engine.check_integrity()
    return predicted, out.num_cached_tokens, out.outputs[0].token_ids


@pytest.mark.parametrize("flags", [
    {"kv_cache_mib": 16},                                                   # device only, room for all
    {"kv_cache_mib": 2, "prefix_cache_mib": 2, "host_cache_memory": "64MiB"},  # two device slots + host tier
], ids=["device", "host-tier"])
def test_index_predicts_the_cached_tokens_of_follow_up_turns(flags: dict[str, object]) -> None:
    llm = LLM(**CPU.engine_kwargs(), **flags)  # type: ignore[arg-type]  # keyword arguments of LLM
    engine = llm.llm_engine
    index = JointIndex(engine.config.cache.block_size, engine.cache.block_hash)
    system = _tokens(40, seed=1)
    history = {c: system + _tokens(50 + 17 * c, seed=10 + c) for c in range(4)}
    epoch, hits = 0, 0
    for turn in range(3):
        for c in range(4):
            epoch += 1
            predicted, cached, output = _predict_and_run(llm, index, epoch, history[c])
            assert predicted == cached, f"turn {turn}, conversation {c}"
            hits += cached > 0
            history[c] = history[c] + output + _tokens(9 + 5 * c, seed=100 * turn + c)
    # a shorter prompt inside a cached one, a branch off it, and another tenant's copy of it
    for prompt in (history[0][:70], history[1][:90] + _tokens(30, seed=77)):
        epoch += 1
        predicted, cached, _ = _predict_and_run(llm, index, epoch, prompt)
        assert predicted == cached
    epoch += 1
    predicted, cached, _ = _predict_and_run(llm, index, epoch, history[2], salt="tenant-b")
    assert predicted == cached == 0
    assert hits >= 8  # the later turns did hit (the check above is not vacuous)
    if "host_cache_memory" in flags:
        tiers = {boundary[2] for boundary in engine.routing_summary(epoch + 1)["ends"] + [
            row[1:] for row in engine.routing_summary(epoch + 1)["tails"]]}
        assert 1 in tiers, "the host tier's entries are published too"


def test_summary_lists_only_snapshots_whose_prefix_kv_is_present() -> None:
    llm = LLM(**CPU.engine_kwargs(), kv_cache_mib=16)
    engine = llm.llm_engine
    prompt = _tokens(100, seed=3)
    llm.generate([prompt], PARAMS, use_tqdm=False)
    boundaries = engine.cache.joint_boundaries()
    assert boundaries and all(b.tier == "device" for b in boundaries)
    # the KV blocks lose their hashes, the snapshots stay: none of them is a joint hit any more
    engine.cache.block_pool.evict_all_cached()
    assert engine.cache.snapshots is not None and engine.cache.snapshots.num_published > 0
    assert engine.cache.joint_boundaries() == []
    index = JointIndex(engine.config.cache.block_size, engine.cache.block_hash)
    index.update("replica", engine.routing_summary(1))
    assert index.depths(prompt + [1, 2, 3], None) == {"replica": 0}
    out = llm.generate([prompt + [1, 2, 3]], PARAMS, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0

"""Lower cache tiers in the live engine (TP=1): a device snapshot pool of two slots and a small KV
pool push snapshots and KV down to host memory or disk; later turns are served from there, with
outputs identical to the cache off, and a disk tier survives a restart of the engine."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.cache.tiers import TierStats
from hybridserve.config import CacheConfig, EngineConfig
from hybridserve.engine.engine import LLMEngine
from tests.helpers.targets import CPU

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
SMALL_POOLS = {"kv_cache_mib": 2, "prefix_cache_mib": 2}  # 64 blocks of 16 tokens, two snapshot slots


def _tokens(length: int, seed: int) -> list[int]:
    return torch.randint(0, 4000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(**kwargs: object) -> LLM:
    return LLM(**CPU.engine_kwargs(), **kwargs)  # type: ignore[arg-type]  # keyword arguments of LLM


def _conversations(llm: LLM) -> list[tuple[list[int], list[dict[int, float]] | None, int]]:
    """Four interleaved multi-turn conversations and a branch off the first one's first turn, one
    request at a time: (greedy tokens, logprobs, cached prompt tokens) per request."""
    history = {c: _tokens(120 + 10 * c, seed=c) for c in range(4)}
    first_turn = list(history[0])
    results = []
    for turn in range(3):
        for c in range(4):
            out = llm.generate([history[c]], PARAMS, use_tqdm=False)[0]
            completion = out.outputs[0]
            results.append((completion.token_ids, completion.logprobs, out.num_cached_tokens))
            history[c] = history[c] + completion.token_ids + _tokens(20, seed=100 * turn + c)
        llm.llm_engine.check_integrity()
    branch = llm.generate([first_turn + _tokens(30, seed=999)], PARAMS, use_tqdm=False)[0]
    results.append((branch.outputs[0].token_ids, branch.outputs[0].logprobs, branch.num_cached_tokens))
    llm.llm_engine.check_integrity()
    return results


@pytest.fixture(scope="module")
def reference() -> list[tuple[list[int], list[dict[int, float]] | None, int]]:
    """The same requests with the prefix cache off."""
    return _conversations(_llm(kv_cache_mib=2, prefix_cache_mib=0))


def _assert_same_outputs(got: list[tuple[list[int], list[dict[int, float]] | None, int]],
                         want: list[tuple[list[int], list[dict[int, float]] | None, int]]) -> None:
    for (tokens, logprobs, _), (ref_tokens, ref_logprobs, _) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        assert logprobs is not None and ref_logprobs is not None
        for row, ref_row in zip(logprobs, ref_logprobs, strict=True):
            assert row.keys() == ref_row.keys()
            assert max(abs(row[t] - ref_row[t]) for t in row) <= CPU.logit_atol


def _tier(llm: LLM, name: str) -> TierStats:
    return next(stats for stats in llm.tier_stats() if stats.name == name)


@pytest.mark.parametrize("write_policy", ["write-through", "write-back"])  # the default first
def test_host_tier_serves_later_turns_with_identical_outputs(reference: list, write_policy: str) -> None:
    llm = _llm(**SMALL_POOLS, host_cache_memory="64MiB", tier_write_policy=write_policy)
    assert llm.llm_engine.config.cache.tier_write_policy == write_policy
    results = _conversations(llm)
    _assert_same_outputs(results, reference)
    host = _tier(llm, "host")
    assert host.demotions > 0 and host.promotions > 0
    assert host.hits > 0 and host.hit_tokens >= 120 * host.hits
    assert host.promoted_objects > host.promotions  # KV blocks were loaded too, not only states
    assert host.failed == 0
    assert sum(cached for _, _, cached in results) >= host.hit_tokens
    stats = llm.llm_engine.stats()
    assert stats["tier_host_hits"] == host.hits and stats["tier_host_budget_bytes"] == 64 << 20
    llm.llm_engine.shutdown()


def _private_dir(path: Path) -> str:
    path.mkdir(mode=0o700)
    os.chmod(path, 0o700)
    return str(path)


def test_disk_tier_serves_later_turns_with_identical_outputs(reference: list, tmp_path: Path) -> None:
    llm = _llm(**SMALL_POOLS, disk_cache_dir=_private_dir(tmp_path / "tiers"), disk_cache_size="64MiB")
    results = _conversations(llm)
    _assert_same_outputs(results, reference)
    disk = _tier(llm, "disk")
    assert disk.hits > 0 and disk.failed == 0
    llm.llm_engine.shutdown()


def test_disk_writes_are_held_during_each_forward(tmp_path: Path) -> None:
    """Background tier writes wait while a forward runs (they run between steps, or anyway once
    their queue is half full), and are released even when the forward fails."""
    llm = _llm(**SMALL_POOLS, disk_cache_dir=_private_dir(tmp_path / "tiers"), disk_cache_size="64MiB")
    engine = llm.llm_engine
    mover, executor = engine.tier_mover, engine.executor
    assert mover is not None
    disk = mover.movers["disk"]
    seen: list[object] = []
    forward = executor.execute

    def recording_forward(plan: object) -> object:
        seen.append(disk._held)
        if len(seen) == 2:
            raise RuntimeError("a failing forward")
        return forward(plan)  # type: ignore[arg-type]

    executor.execute = recording_forward  # type: ignore[method-assign]
    llm.generate([_tokens(100, seed=7)], PARAMS, use_tqdm=False)
    assert seen[:2] == [True, True] and not disk._held  # held in each forward, released after the failed one
    engine.check_integrity()
    engine.shutdown()


@pytest.mark.slow  # the cascade path on top of the host and disk cases above
def test_host_cascades_to_disk_and_disk_serves(reference: list, tmp_path: Path) -> None:
    llm = _llm(**SMALL_POOLS, host_cache_memory="4MiB",
               disk_cache_dir=_private_dir(tmp_path / "tiers"), disk_cache_size="64MiB")
    results = _conversations(llm)
    _assert_same_outputs(results, reference)
    host, disk = _tier(llm, "host"), _tier(llm, "disk")
    assert host.evictions > 0 and disk.demotions > 0  # host entries pushed down to disk
    assert host.hits + disk.hits > 0 and host.failed == disk.failed == 0
    llm.llm_engine.shutdown()


def test_disk_tier_survives_a_restart_and_ignores_another_dtype(tmp_path: Path) -> None:
    directory = _private_dir(tmp_path / "tiers")
    flags = {**SMALL_POOLS, "disk_cache_dir": directory, "disk_cache_size": "64MiB"}  # the default write-through
    prompt = _tokens(400, seed=7)
    first = _llm(**flags)
    want = first.generate([prompt], PARAMS, use_tqdm=False)[0]
    assert want.num_cached_tokens == 0
    first.llm_engine.shutdown()

    restarted = _llm(**flags)
    got = restarted.generate([prompt], PARAMS, use_tqdm=False)[0]
    assert got.num_cached_tokens >= 3 * len(prompt) // 4  # restored from the disk tier
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert _tier(restarted, "disk").hits == 1
    restarted.llm_engine.check_integrity()
    restarted.llm_engine.shutdown()

    other_dtype = LLM(device=CPU.device, dtype="bfloat16", **flags)  # type: ignore[arg-type]
    assert other_dtype.generate([prompt], PARAMS, use_tqdm=False)[0].num_cached_tokens == 0
    assert _tier(other_dtype, "disk").hits == 0
    other_dtype.llm_engine.shutdown()


def test_a_corrupt_disk_object_is_a_counted_miss_not_a_wrong_restore(tmp_path: Path) -> None:
    directory = _private_dir(tmp_path / "tiers")
    flags = {**SMALL_POOLS, "disk_cache_dir": directory, "disk_cache_size": "64MiB",
             "tier_write_policy": "write-through"}
    prompt = _tokens(300, seed=11)
    first = _llm(**flags)
    want = first.generate([prompt], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    first.llm_engine.shutdown()
    kv_files = sorted(Path(directory).glob("*/kv-*.obj"))
    assert kv_files
    for path in kv_files:  # flip a payload byte of every KV object: each fails its checksum
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))

    restarted = _llm(**flags)
    out = restarted.generate([prompt], PARAMS, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want
    assert out.num_cached_tokens == 0
    disk = _tier(restarted, "disk")
    assert disk.promotions >= 1 and disk.failed >= 1 and disk.hits == 0
    restarted.llm_engine.check_integrity()
    restarted.llm_engine.shutdown()


CHUNK_PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)


def _three_chunk_prefix_pushed_down(**tier: object) -> tuple[LLM, list[int], Any]:
    """An engine with `tier` whose device pools no longer hold a prefix of three promotion chunks
    of KV blocks (the tier does), a prompt on that prefix, and its cache-off output."""
    from hybridserve.engine.tier_mover import PROMOTION_CHUNK

    depth = 3 * PROMOTION_CHUNK * 16  # KV blocks of 16 tokens
    prefix, prompt = _tokens(depth, seed=21), _tokens(depth, seed=21) + _tokens(8, seed=22)
    want = _llm(kv_cache_mib=8, prefix_cache_mib=0).generate([prompt], CHUNK_PARAMS, use_tqdm=False)[0]
    llm = _llm(kv_cache_mib=8, prefix_cache_mib=2, snapshot_interval=depth, cache_policy="interval", **tier)
    llm.generate([prefix + _tokens(8, seed=23)], CHUNK_PARAMS, use_tqdm=False)
    for seed in (24, 25):  # as long as the prefix: push it off the device (it is in the tier already)
        llm.generate([_tokens(depth + 8, seed=seed)], CHUNK_PARAMS, use_tqdm=False)
    return llm, prompt, want


def _flip_a_payload_byte(store: Any, key: str) -> None:
    """A corrupt disk object: one payload byte of its file flipped (its checksum fails)."""
    path = store.path / f"{key}.obj"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


def _reshape_host_object(store: Any, key: str) -> None:
    """A host object of the wrong layout: replaced by one of another shape."""
    payload = store.get(key)
    assert payload is not None
    store.put(key, {name: tensor[:, :1] for name, tensor in payload.items()})


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_bad_object_in_a_later_chunk_fails_the_promotion_after_earlier_chunks_landed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tier: str) -> None:
    """A promotion lands chunk by chunk in its reserved blocks, in place on the store's thread; a bad
    object in a later chunk (a wrong-shaped host object, a corrupt disk file: a counted corrupt miss)
    fails the whole ticket: the blocks and slot the earlier chunks landed in are never published,
    the request recomputes with the cache-off output, and nothing leaks."""
    import itertools

    from hybridserve.cache.tier_store import DiskStore, HostStore
    from hybridserve.engine.tier_mover import PROMOTION_CHUNK

    store_class, spoil = (HostStore, _reshape_host_object) if tier == "host" else (DiskStore, _flip_a_payload_byte)
    flags = {"host_cache_memory": "128MiB"} if tier == "host" else {
        "disk_cache_dir": _private_dir(tmp_path / "tiers"), "disk_cache_size": "128MiB"}
    llm, prompt, want = _three_chunk_prefix_pushed_down(**flags)
    landed: list[bool] = []
    chunks = itertools.count()
    real_get_many_into = store_class.get_many_into

    def get_many_into(store: Any, keys: list[str], targets: list[object]) -> list[bool]:
        if next(chunks) == 1:  # the second chunk: its last object spoiled
            spoil(store, keys[-1])
        landed.extend(real_get_many_into(store, keys, targets))
        return landed[-len(keys):]

    monkeypatch.setattr(store_class, "get_many_into", get_many_into)
    got = llm.generate([prompt], CHUNK_PARAMS, use_tqdm=False)[0]
    stats = _tier(llm, tier)
    assert sum(landed) >= PROMOTION_CHUNK and not all(landed)  # landed in part, then a bad one
    assert stats.failed == 1 and stats.hits == 0
    store = next(s for s in llm.llm_engine.tier_mover.store_stats() if s.tier == tier)  # type: ignore[union-attr]
    assert store.corrupt_misses == (tier == "disk")
    assert got.num_cached_tokens == 0 and got.outputs[0].token_ids == want.outputs[0].token_ids
    llm.llm_engine.check_integrity()
    monkeypatch.undo()
    again = llm.generate([prompt], CHUNK_PARAMS, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want.outputs[0].token_ids
    llm.llm_engine.check_integrity()
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_promotion_part_in_place_part_installed_restores_exactly(tmp_path: Path, tier: str) -> None:
    """Where only some of a promotion's objects can land in place (here the snapshot slot cannot),
    those read in place and the others are installed: all of them arrive, the restore is whole and
    the output is the cache-off one."""
    flags = {"host_cache_memory": "128MiB"} if tier == "host" else {
        "disk_cache_dir": _private_dir(tmp_path / "tiers"), "disk_cache_size": "128MiB"}
    llm, prompt, want = _three_chunk_prefix_pushed_down(**flags)
    pools = llm.llm_engine.tier_mover.pools  # type: ignore[union-attr]
    pools._in_place.pop("state")
    got = llm.generate([prompt], CHUNK_PARAMS, use_tqdm=False)[0]
    stats = _tier(llm, tier)
    assert stats.hits == 1 and stats.failed == 0 and got.num_cached_tokens == len(prompt) - 8
    _assert_same_outputs([(got.outputs[0].token_ids, got.outputs[0].logprobs, 0)],
                         [(want.outputs[0].token_ids, want.outputs[0].logprobs, 0)])
    llm.llm_engine.check_integrity()
    llm.llm_engine.shutdown()


def test_tensor_parallel_engine_refuses_lower_tiers() -> None:
    config = EngineConfig(**CPU.engine_kwargs(), tensor_parallel_size=2,
                          cache=CacheConfig(host_cache_memory_bytes=1 << 20))
    with pytest.raises(ValueError, match="not supported with tensor_parallel_size=2"):
        LLMEngine(config)


def test_a_prefix_deeper_than_the_store_queue_restores_from_host() -> None:
    """A promotion submits one get per KV block of its prefix at once: a prefix of more blocks than
    the store mover's default queue bound must still come back whole from the host tier."""
    from hybridserve.cache.store_mover import DEFAULT_MAX_PENDING

    depth = (DEFAULT_MAX_PENDING + 16) * 16  # KV blocks of 16 tokens
    llm = _llm(kv_cache_mib=4, prefix_cache_mib=2, snapshot_interval=depth, cache_policy="interval",
               host_cache_memory="128MiB")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    prefix = _tokens(depth, seed=7)
    first = llm.generate([prefix + _tokens(8, seed=8)], params, use_tqdm=False)[0]
    for seed in (9, 10):  # as long as the prefix: push its snapshot and KV down to the host tier
        llm.generate([_tokens(depth + 8, seed=seed)], params, use_tqdm=False)
    again = llm.generate([prefix + _tokens(8, seed=8)], params, use_tqdm=False)[0]
    host = _tier(llm, "host")
    assert again.num_cached_tokens == depth and host.hits >= 1 and host.failed == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    llm.llm_engine.check_integrity()



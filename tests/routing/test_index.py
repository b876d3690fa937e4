"""JointIndex and the summary format against hand-built boundaries (no engine)."""

from __future__ import annotations

import json
import pickle
import random

import pytest

from hybridserve.cache.block_pool import KeyedHash, block_hashes_for, hash_tail
from hybridserve.routing.index import JointIndex
from hybridserve.routing.summary import JointBoundary, decode_summary, encode_summary, hash_identity

SIZE = 16
ALGO = KeyedHash(12345)


def tokens(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4096) for _ in range(count)]


def end_boundary(prompt: list[int], blocks: int, salt: str | None = None, tier: str = "device") -> JointBoundary:
    extra = () if salt is None else (salt,)
    key = block_hashes_for(prompt[:blocks * SIZE], SIZE, extra, algorithm=ALGO)[-1]
    return JointBoundary(key, None, blocks * SIZE, tier)


def tail_boundary(prompt: list[int], num_tokens: int, salt: str | None = None) -> JointBoundary:
    extra = () if salt is None else (salt,)
    full = num_tokens // SIZE
    hashes = block_hashes_for(prompt[:full * SIZE], SIZE, extra, algorithm=ALGO)
    parent = hashes[-1] if hashes else None
    return JointBoundary(hash_tail(parent, prompt[full * SIZE:num_tokens], extra, ALGO), parent, num_tokens, "host")


def summary(boundaries: list[JointBoundary], epoch: int = 1) -> dict:
    return encode_summary(boundaries, SIZE, epoch, hash_identity(ALGO))


def test_summary_round_trips_through_json_and_pickle_and_keeps_the_fastest_tier() -> None:
    prompt = tokens(100, 1)
    rows = [end_boundary(prompt, 2, tier="disk"), end_boundary(prompt, 2), tail_boundary(prompt, 37),
            tail_boundary(prompt, 5)]
    encoded = summary(rows, epoch=7)
    for copy in (json.loads(json.dumps(encoded)), pickle.loads(pickle.dumps(encoded))):
        decoded = decode_summary(copy)
        assert decoded.epoch == 7 and decoded.block_size == SIZE and decoded.hash_id == hash_identity(ALGO)
        assert sorted(decoded.boundaries) == sorted(rows[1:])
    with pytest.raises(ValueError, match="format"):
        decode_summary({**encoded, "format": 99})
    with pytest.raises(ValueError, match="malformed"):
        decode_summary({**encoded, "ends": [["zz", 16, 0]]})


def test_depth_is_the_deepest_boundary_on_the_path_per_replica() -> None:
    prompt = tokens(200, 2)
    index = JointIndex(SIZE, ALGO)
    index.update("a", summary([end_boundary(prompt, 3), end_boundary(prompt, 8)]))
    index.update("b", summary([end_boundary(prompt, 3), tail_boundary(prompt, 100)]))
    index.update("c", summary([end_boundary(tokens(200, 3), 10)]))  # another prompt's path
    index.add_replica("d")
    assert index.depths(prompt, None) == {"a": 128, "b": 100, "c": 0, "d": 0}
    # a boundary at the prompt's end is not a hit: one token is always computed
    assert index.depths(prompt[:128], None)["a"] == 48
    assert index.depths(prompt[:129], None)["a"] == 128
    assert index.depths(prompt[:100], None)["b"] == 48 and index.depths(prompt[:101], None)["b"] == 100
    # a diverging prompt keeps only the shared part
    other = prompt[:60] + tokens(140, 4)
    assert index.depths(other, None) == {"a": 48, "b": 48, "c": 0, "d": 0}
    assert index.depths([], None) == {"a": 0, "b": 0, "c": 0, "d": 0}


def test_tails_at_the_root_and_salts() -> None:
    prompt = tokens(40, 5)
    index = JointIndex(SIZE, ALGO)
    index.update("a", summary([tail_boundary(prompt, 9), tail_boundary(prompt, 12)]))
    index.update("t", summary([end_boundary(prompt, 2, salt="tenant"), tail_boundary(prompt, 35, salt="tenant")]))
    assert index.depths(prompt, None) == {"a": 12, "t": 0}
    assert index.depths(prompt, "tenant") == {"a": 0, "t": 35}
    assert index.depths(prompt, "other") == {"a": 0, "t": 0}


def test_stale_and_lost_summaries_are_tolerated() -> None:
    prompt = tokens(100, 6)
    index = JointIndex(SIZE, ALGO)
    assert index.update("a", summary([end_boundary(prompt, 4)], epoch=5))
    assert not index.update("a", summary([end_boundary(prompt, 2)], epoch=4))  # older: ignored
    assert not index.update("a", summary([], epoch=5))
    assert index.depths(prompt, None) == {"a": 64} and index.epoch("a") == 5
    assert index.update("a", summary([tail_boundary(prompt, 20)], epoch=6))  # newer replaces, not merges
    assert index.depths(prompt, None) == {"a": 20} and index.num_boundaries("a") == 1
    index.remove("a")
    assert index.depths(prompt, None) == {}
    assert index.update("a", summary([end_boundary(prompt, 1)], epoch=0))  # a restarted replica starts afresh
    assert index.depths(prompt, None) == {"a": 16}
    index.update("a", summary([], epoch=1))
    assert index._holders == {} and index._tail_lengths == {}  # nothing left behind


def test_mismatched_block_size_or_seed_is_refused() -> None:
    index = JointIndex(SIZE, ALGO)
    with pytest.raises(ValueError, match="block"):
        index.update("a", encode_summary([], 32, 1, hash_identity(ALGO)))
    with pytest.raises(ValueError, match="seed"):
        index.update("a", encode_summary([], SIZE, 1, hash_identity(KeyedHash(99))))
    assert str(ALGO.seed) not in hash_identity(ALGO)  # the identity never spells the seed out


def test_depths_match_a_brute_force_scan_on_random_boundaries() -> None:
    rng = random.Random(7)
    base = tokens(400, 8)
    prompts = [base[:rng.randrange(20, 400)] + tokens(rng.randrange(0, 80), 100 + i) for i in range(30)]
    replicas: dict[str, list[JointBoundary]] = {f"r{i}": [] for i in range(4)}
    for prompt in prompts:
        for boundaries in replicas.values():
            if rng.random() < 0.4:
                depth = rng.randrange(1, len(prompt) + 1)
                boundaries.append(end_boundary(prompt, depth // SIZE) if depth % SIZE == 0
                                  else tail_boundary(prompt, depth))
    index = JointIndex(SIZE, ALGO)
    for name, boundaries in replicas.items():
        index.update(name, summary(boundaries))
    for prompt in prompts + [base]:
        limit = len(prompt) - 1
        expected = {}
        for name, boundaries in replicas.items():
            keys = {b.key for b in boundaries}
            on_path = [n for n in range(1, limit + 1)
                       if (tail_boundary(prompt, n).key if n % SIZE else end_boundary(prompt, n // SIZE).key) in keys]
            expected[name] = max(on_path, default=0)
        assert index.depths(prompt, None) == expected

"""The shared remote tier in live engines: two `LLM` "replicas" of the built-in model share one real
redis-server and one block-hash seed. A conversation's next turn served by the replica that did not
run the previous one restores from the store (`cached_tokens` > 0) with greedy output identical to a
cold run; corrupt objects, a store that dies or is unreachable, another seed, another model and
another tenant never give a wrong output or a false hit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.cache.tiers import TierStats
from tests.cache.test_remote_store import REDIS_SERVER, RedisServer, redis_server, requires_redis
from tests.helpers.targets import CPU

__all__ = ["redis_server"]  # the fixture, imported for the tests below

pytestmark = requires_redis
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SEED = 0x5EED
POOLS = {"kv_cache_mib": 2, "prefix_cache_mib": 2}  # 64 blocks of 16 tokens, two snapshot slots


def _tokens(length: int, seed: int) -> list[int]:
    return torch.randint(0, 4000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _replica(url: str, **kwargs: object) -> LLM:
    flags: dict[str, object] = {**CPU.engine_kwargs(), **POOLS, "remote_cache_url": url, "block_hash_seed": SEED,
                                **kwargs}
    return LLM(**flags)  # type: ignore[arg-type]  # keyword arguments of LLM


def _remote(llm: LLM) -> TierStats:
    return next(stats for stats in llm.tier_stats() if stats.name == "remote")


def _settle(llm: LLM, timeout: float = 10.0) -> None:
    """Wait until the replica's transfers (write-through to the store included) have completed."""
    engine = llm.llm_engine
    deadline = time.monotonic() + timeout
    while engine.tier_mover is not None and engine.tier_mover.busy and time.monotonic() < deadline:
        engine.cache.poll_tiers()
        engine.tier_mover.wait(0.01)
    engine.cache.poll_tiers()


def _turn(llm: LLM, prompt: list[int], salt: str | None = None) -> tuple[list[int], int]:
    out = llm.generate([prompt], PARAMS, cache_salt=salt, use_tqdm=False)[0]
    llm.llm_engine.check_integrity()
    return out.outputs[0].token_ids, out.num_cached_tokens


class Replicas:
    """Two replicas sharing one store and seed, and a cold reference (prefix cache off)."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.one, self.two = _replica(server.url), _replica(server.url)
        self.cold = LLM(**CPU.engine_kwargs(), kv_cache_mib=2, prefix_cache_mib=0)  # type: ignore[arg-type]

    def conversation(self, seed: int) -> tuple[list[int], list[int]]:
        """Turn one on replica one (settled into the store), and the next turn's prompt."""
        first = _tokens(300, seed)
        answer, cached = _turn(self.one, first)
        assert cached == 0
        _settle(self.one)
        return first, first + answer + _tokens(20, seed + 1)

    def close(self) -> None:
        for llm in (self.one, self.two, self.cold):
            llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (.ci/run installs it with apt-get)")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    group = Replicas(server)
    try:
        yield group
    finally:
        group.close()
        server.stop()


def test_the_next_turn_on_another_replica_restores_from_the_store(replicas: Replicas) -> None:
    first, second = replicas.conversation(seed=1)
    before = _remote(replicas.two)
    tokens, cached = _turn(replicas.two, second)
    assert cached >= len(first)  # the end of turn one (its prompt and answer) came from the store
    assert tokens == _turn(replicas.cold, second)[0]
    after = _remote(replicas.two)
    assert after.hits == before.hits + 1 and after.hit_tokens - before.hit_tokens == cached
    assert after.discovered == before.discovered + 1 and after.lookups == before.lookups + 1
    assert after.promoted_bytes > before.promoted_bytes and after.failed == before.failed
    stats = replicas.two.llm_engine.stats()
    assert stats["tier_remote_hits"] == after.hits and stats["tier_remote_lookups"] == after.lookups
    assert _remote(replicas.one).demoted_bytes > 0  # replica one wrote it through


def test_another_tenant_never_matches(replicas: Replicas) -> None:
    first = _tokens(300, seed=11)
    answer, _ = _turn(replicas.one, first, salt="tenant-a")
    _settle(replicas.one)
    second = first + answer + _tokens(20, seed=12)
    tokens, cached = _turn(replicas.two, second, salt="tenant-b")
    assert cached == 0 and tokens == _turn(replicas.cold, second)[0]
    tokens, cached = _turn(replicas.two, second, salt="tenant-a")  # the same tenant does
    assert cached >= len(first) and tokens == _turn(replicas.cold, second)[0]


def test_a_corrupt_object_is_a_counted_miss_with_the_right_output(replicas: Replicas) -> None:
    import redis

    first, second = replicas.conversation(seed=21)
    client = redis.Redis.from_url(replicas.server.url)
    states = list(client.scan_iter(match="hs:*:state-*"))
    assert states
    for key in states:  # flip the last byte of every state: each fails its checksum
        raw = client.get(key)
        assert isinstance(raw, bytes)
        client.set(key, raw[:-1] + bytes([raw[-1] ^ 0xFF]))
    before = _remote(replicas.two)
    tokens, cached = _turn(replicas.two, second)
    after = _remote(replicas.two)
    assert tokens == _turn(replicas.cold, second)[0]
    assert after.failed == before.failed + 1 and after.hits == before.hits and after.discovered > before.discovered
    assert cached == 0
    assert sum(1 for key in states if client.exists(key)) < len(states)  # the corrupt one read is deleted
    client.close()


def test_an_unreachable_store_fails_at_start_with_one_line(redis_server: RedisServer) -> None:
    url = redis_server.url
    redis_server.stop()
    with pytest.raises(ValueError, match=f"remote cache store {url} is unreachable") as caught:
        _replica(url)
    assert "\n" not in str(caught.value)


def test_a_random_block_hash_seed_is_refused(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYBRIDSERVE_BLOCK_HASH_SEED", raising=False)
    with pytest.raises(ValueError, match="needs --block-hash-seed"):
        _replica(redis_server.url, block_hash_seed=None)


@pytest.mark.slow  # two more engines
def test_another_seed_or_model_never_matches(redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    one = _replica(redis_server.url)
    first = _tokens(300, seed=31)
    answer, _ = _turn(one, first)
    _settle(one)
    second = first + answer + _tokens(20, seed=32)
    other_seed = _replica(redis_server.url, block_hash_seed=SEED + 1)
    assert "under 1 other block-hash seed" in caplog.text  # the start-up warning names the mistake
    assert _turn(other_seed, second)[1] == 0 and _remote(other_seed).discovered == 0
    other_model = _replica(redis_server.url, dtype="bfloat16")
    assert _turn(other_model, second)[1] == 0 and _remote(other_model).discovered == 0
    for llm in (one, other_seed, other_model):
        llm.llm_engine.shutdown()


@pytest.mark.slow  # a store killed and restarted under a running replica
def test_a_store_that_dies_mid_run_gives_misses_never_errors(redis_server: RedisServer,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridserve.cache import remote_store

    monkeypatch.setattr(remote_store, "RETRY_AFTER_S", 0.1)
    one, two = _replica(redis_server.url), _replica(redis_server.url)
    cold = LLM(**CPU.engine_kwargs(), kv_cache_mib=2, prefix_cache_mib=0)  # type: ignore[arg-type]
    first = _tokens(300, seed=41)
    answer, _ = _turn(one, first)
    _settle(one)
    redis_server.stop()
    second = first + answer + _tokens(20, seed=42)
    for prompt in (second, _tokens(250, seed=43)):
        tokens, cached = _turn(two, prompt)  # misses, no error, the right output
        assert cached == 0 and tokens == _turn(cold, prompt)[0]
    _settle(two)
    assert _remote(two).hits == 0
    redis_server.start()  # back, empty: the replicas forget their books of it, write and find again
    time.sleep(3 * remote_store.RETRY_AFTER_S)
    first = _tokens(300, seed=44)
    answer, _ = _turn(one, first)
    _settle(one)
    second = first + answer + _tokens(20, seed=45)
    tokens, cached = _turn(two, second)
    assert cached >= len(first) and _remote(two).hits == 1 and tokens == _turn(cold, second)[0]
    for llm in (one, two, cold):
        llm.llm_engine.shutdown()


_KILLED_REPLICA = textwrap.dedent("""
    import sys, time
    from hybridserve import LLM, SamplingParams
    llm = LLM(device="cpu", dtype="float32", kv_cache_mib=2, prefix_cache_mib=2,
              remote_cache_url=sys.argv[1], block_hash_seed=int(sys.argv[2]))
    prompt = [int(t) for t in sys.argv[3].split(",")]
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    while llm.llm_engine.tier_mover.busy:  # the write-through is asynchronous: answer once it is done
        llm.llm_engine.step()
        time.sleep(0.01)
    print(",".join(map(str, out[0].outputs[0].token_ids)), flush=True)
    while True:  # serving on, until killed (nothing is flushed at exit)
        llm.llm_engine.step()
        time.sleep(0.01)
""")


@pytest.mark.slow  # a replica process killed with SIGKILL after answering
def test_a_replica_killed_with_sigkill_has_already_shared_its_turn(redis_server: RedisServer) -> None:
    import redis

    first = _tokens(300, seed=51)
    child = subprocess.Popen([sys.executable, "-c", _KILLED_REPLICA, redis_server.url, str(SEED),
                              ",".join(map(str, first))], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2], env={**os.environ, "PYTHONPATH": "."})
    assert child.stdout is not None
    answer = [int(t) for t in child.stdout.readline().strip().split(",")]
    os.kill(child.pid, signal.SIGKILL)  # nothing is flushed at exit
    child.wait()
    client = redis.Redis.from_url(redis_server.url)
    assert any(client.scan_iter(match="hs:*:entry-*"))
    client.close()
    survivor = _replica(redis_server.url)
    cold = LLM(**CPU.engine_kwargs(), kv_cache_mib=2, prefix_cache_mib=0)  # type: ignore[arg-type]
    second = first + answer + _tokens(20, seed=52)
    tokens, cached = _turn(survivor, second)
    assert cached >= len(first) and tokens == _turn(cold, second)[0]
    for llm in (survivor, cold):
        llm.llm_engine.shutdown()

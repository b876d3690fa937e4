"""The remote tier's store (`RemoteStore`) against a real `redis-server` started on a free port in a
temporary directory: round trips, namespaces, checksums, the discovery index, a server that goes
away and comes back, and start-up errors. `RedisServer` and the `redis_server` fixture are shared
with tests/cache/test_remote_tier.py."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hybridserve.cache.block_pool import block_hashes_for, hash_tail
from hybridserve.cache.tiers import DiscoveryQuery, JointEntry
from hybridserve.config import CacheConfig

REDIS_SERVER = shutil.which("redis-server")
requires_redis = pytest.mark.skipif(REDIS_SERVER is None,
                                    reason="redis-server is not installed (.ci/run installs it with apt-get)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A private redis-server process (no persistence, LRU eviction under `maxmemory`)."""

    def __init__(self, directory: Path, maxmemory: str = "256mb", extra: tuple[str, ...] = ()) -> None:
        assert REDIS_SERVER is not None
        self.directory = directory
        self.maxmemory = maxmemory
        self.extra = extra
        self.port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        """The server's URL (database 0)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start (or restart, on the same port) the server and wait until it answers."""
        assert REDIS_SERVER is not None
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--save", "", "--appendonly", "no", "--maxmemory", self.maxmemory,
             "--maxmemory-policy", "allkeys-lru", *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(64).startswith((b"+PONG", b"-NOAUTH")):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        """Kill the server (its data is gone: no persistence)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server for one test."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (.ci/run installs it with apt-get)")
    server = RedisServer(tmp_path)
    try:
        yield server
    finally:
        server.stop()


def _store(url: str, fingerprint: str = "f" * 32):  # type: ignore[no-untyped-def]  # RemoteStore (imports redis)
    from hybridserve.cache.remote_store import RemoteStore

    return RemoteStore(url, fingerprint)


def _payload(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"keys": torch.randn(2, 16, 4, generator=generator), "values": torch.randn(2, 16, 4, generator=generator)}


@requires_redis
def test_round_trip_is_exact_and_namespaced_by_fingerprint(redis_server: RedisServer) -> None:
    store, other = _store(redis_server.url), _store(redis_server.url, "e" * 32)
    payload = _payload(1)
    assert store.put("kv-01", payload).ok
    got = store.get("kv-01")
    assert got is not None and got.keys() == payload.keys()
    assert all(torch.equal(got[name], payload[name]) and got[name].dtype == payload[name].dtype for name in payload)
    assert other.get("kv-01") is None  # another model (or seed) sees nothing
    assert store.keys() == ["kv-01"] and other.keys() == []
    stats = store.stats()
    assert stats.puts == 1 and stats.hits == 1 and other.stats().missing_misses == 1
    store.close()
    other.close()


@requires_redis
def test_a_corrupt_or_truncated_value_is_a_counted_miss_and_deleted(redis_server: RedisServer) -> None:
    import redis

    store = _store(redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    for key, damage in (("kv-a", lambda b: b[:-1] + bytes([b[-1] ^ 0xFF])), ("kv-b", lambda b: b[:-7]),
                        ("kv-c", lambda b: b"junk"), ("kv-d", lambda b: b.replace(b"kv-d", b"kv-x", 1))):
        assert store.put(key, _payload(2)).ok
        raw = client.get(store.namespace + key)
        assert isinstance(raw, bytes)
        client.set(store.namespace + key, damage(raw))
        assert store.get(key) is None
        assert not client.exists(store.namespace + key)  # deleted: a miss for every replica after
    assert store.stats().corrupt_misses == 4
    client.close()
    store.close()


@requires_redis
def test_a_store_that_goes_away_gives_misses_and_recovers(redis_server: RedisServer,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridserve.cache import remote_store

    monkeypatch.setattr(remote_store, "RETRY_AFTER_S", 0.05)
    store = _store(redis_server.url)
    assert store.put("kv-1", _payload(3)).ok
    redis_server.stop()
    start = time.monotonic()
    assert store.get("kv-1") is None
    assert not store.put("kv-2", _payload(4)).ok
    assert store.find_entry(DiscoveryQuery((b"\x01" * 16,), 40, 0, 16, lambda j, t: b"")) == (None, False)
    assert time.monotonic() - start < 2 * remote_store.SOCKET_TIMEOUT_S  # bounded, never hangs
    stats = store.stats()
    assert stats.errors >= 3 and stats.failed_writes == 1 and stats.misses == 1
    redis_server.start()  # same port, empty
    time.sleep(0.1)
    assert store.put("kv-2", _payload(4)).ok
    assert store.get("kv-2") is not None
    store.close()


@requires_redis
def test_an_unreachable_store_at_start_is_one_clear_error(redis_server: RedisServer) -> None:
    from hybridserve.cache.remote_store import RemoteStoreError

    port = _free_port()
    with pytest.raises(RemoteStoreError, match=rf"remote cache store redis://127.0.0.1:{port}/0 is unreachable"):
        _store(f"redis://127.0.0.1:{port}/0")
    with pytest.raises(RemoteStoreError, match=r"redis://:\*\*\*@127.0.0.1"):  # the password is never shown
        _store(f"redis://:secret@127.0.0.1:{port}/0")


def test_bad_urls_fail_the_configuration() -> None:
    for url, message in (("http://h:1/0", "must be redis://"), ("redis:///0", "names no host"),
                         ("redis://h:1/x", "database must be a number"), ("redis://h:99999/0", "remote-cache-url")):
        with pytest.raises(ValueError, match=message):
            CacheConfig(remote_cache_url=url)


def _entry(hashes: list[bytes], blocks: int, tail: bytes | None = None, tail_tokens: int = 0) -> JointEntry:
    if tail is None:
        return JointEntry(hashes[blocks - 1], blocks * 16, tuple(hashes[:blocks]), 0)
    return JointEntry(tail, blocks * 16 + tail_tokens, (*hashes[:blocks], tail), tail_tokens)


@requires_redis
def test_discovery_finds_the_deepest_whole_entry_on_the_path(redis_server: RedisServer) -> None:
    store = _store(redis_server.url)
    tokens = list(range(100))
    hashes = block_hashes_for(tokens, 16)  # six full blocks

    def tail_key(blocks: int, length: int) -> bytes:
        return hash_tail(hashes[blocks - 1] if blocks else None, tokens[blocks * 16:blocks * 16 + length])

    def write(entry: JointEntry) -> None:
        assert store.put(f"state-{entry.key.hex()}", _payload(5)).ok
        for block in entry.blocks:
            assert store.put(f"kv-{block.hex()}", _payload(6)).ok
        assert store.publish_entry(entry)

    def find(limit: int = 99, deeper_than: int = 0) -> JointEntry | None:
        entry, answered = store.find_entry(DiscoveryQuery(tuple(hashes), limit, deeper_than, 16, tail_key))
        assert answered
        return entry

    assert find() is None
    write(_entry(hashes, 2))
    assert find() == _entry(hashes, 2)
    write(_entry(hashes, 3, tail_key(3, 5), 5))  # a request end inside block 4
    assert find() == _entry(hashes, 3, tail_key(3, 5), 5)
    assert find(limit=50) == _entry(hashes, 2)        # beyond the limit: the shallower one
    assert find(deeper_than=53) is None               # not deeper than the local hit
    write(_entry(hashes, 5))
    assert find() == _entry(hashes, 5)
    assert store.delete(f"kv-{hashes[3].hex()}")      # the server evicted block 4: partial, never a hit
    assert find() == _entry(hashes, 3, tail_key(3, 5), 5)
    deepest = _entry(hashes, 6)
    assert store.put(f"state-{deepest.key.hex()}", _payload(5)).ok
    assert store.put(f"kv-{hashes[5].hex()}", _payload(6)).ok
    assert not store.publish_entry(deepest)           # block 4 is missing: never indexed
    assert find() == _entry(hashes, 3, tail_key(3, 5), 5)
    other_tokens = tokens[:40] + [7] * 60             # another prompt sharing two blocks and a half
    other = block_hashes_for(other_tokens, 16)
    entry, _ = store.find_entry(DiscoveryQuery(tuple(other), 99, 0, 16, lambda j, t: hash_tail(
        other[j - 1] if j else None, other_tokens[j * 16:j * 16 + t])))
    assert entry == _entry(hashes, 2)
    salted = block_hashes_for(tokens, 16, ("tenant-b",))  # another tenant's keys: nothing matches
    entry, _ = store.find_entry(DiscoveryQuery(tuple(salted), 99, 0, 16, lambda j, t: hash_tail(
        salted[j - 1] if j else None, tokens[j * 16:j * 16 + t], ("tenant-b",))))
    assert entry is None
    store.close()


@requires_redis
def test_the_budget_is_the_servers_maxmemory_and_a_server_that_never_evicts_is_named(
        redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    import redis

    store = _store(redis_server.url)
    assert store.budget_bytes == 256 << 20 and "maxmemory-policy" not in caplog.text
    store.close()
    client = redis.Redis.from_url(redis_server.url)
    client.config_set("maxmemory-policy", "noeviction")
    client.close()
    _store(redis_server.url).close()
    assert "set maxmemory and maxmemory-policy allkeys-lru" in caplog.text


@requires_redis
def test_a_password_in_the_url_authenticates(tmp_path: Path) -> None:
    from hybridserve.cache.remote_store import RemoteStoreError

    server = RedisServer(tmp_path, extra=("--requirepass", "s3cret"))
    try:
        host = f"127.0.0.1:{server.port}/0"
        store = _store(f"redis://:s3cret@{host}")
        assert store.put("kv-1", _payload(7)).ok and store.get("kv-1") is not None
        store.close()
        with pytest.raises(RemoteStoreError, match=r"redis://:\*\*\*@127.0.0.1") as caught:
            _store(f"redis://:wrong@{host}")
        assert "wrong" not in str(caught.value)
    finally:
        server.stop()


@requires_redis
def test_a_hung_server_costs_a_timeout_never_a_hang(redis_server: RedisServer,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import signal

    from hybridserve.cache import remote_store

    monkeypatch.setattr(remote_store, "SOCKET_TIMEOUT_S", 0.3)
    monkeypatch.setattr(remote_store, "RETRY_AFTER_S", 0.05)
    store = _store(redis_server.url)
    assert store.put("kv-1", _payload(8)).ok
    assert redis_server.process is not None
    os.kill(redis_server.process.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert store.get("kv-1") is None
        assert time.monotonic() - start < 1.5
    finally:
        os.kill(redis_server.process.pid, signal.SIGCONT)
    time.sleep(0.1)
    assert store.get("kv-1") is not None and store.generation == 1  # back: the engine forgets its books
    store.close()

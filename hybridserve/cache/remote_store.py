"""The shared remote tier's store: a Redis server every replica of one model writes its joint entries
to and restores them from (docs/prefix-cache.md, Tiers: the remote tier).

`RemoteStore` has the `ObjectStore` interface and guarantees of `DiskStore`:
- Keys are namespaced by the model fingerprint (`hs:<fingerprint>:<key>`: weights, config,
  tokenizer, dtype, block size, hash function and block-hash key id), so another model or seed finds
  nothing. The tier keys carry the tenant salt (the block hashes fold it in), as in every tier.
- Each value is the disk format: a header (magic, format version, key, payload length, xxh3_128 of
  the payload) then safetensors bytes; a read verifies all of it. A corrupt, truncated or missing
  object is a counted miss (a corrupt one is deleted), never wrong data.
- Every command has a socket timeout and no retries, so a dead or hung server never holds the
  mover thread for long; after a connection failure the store answers misses without trying the
  server for `RETRY_AFTER_S`, then tries again (it recovers when the server returns). Failures are
  counted, never raised to the engine.
- Who evicts: the server (`maxmemory` with `allkeys-lru`); a replica never deletes objects other
  replicas may use, except one it has found corrupt.

Beside the objects the store keeps a small index the discovery lookup reads: `entry-<hex>` (the
entry's boundary and tail length, written once all its objects are written) and, per parent block,
`tails-<parent hex>` (the set of tail lengths of entries ending inside the next block).
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import redis
import torch
import xxhash
from redis.backoff import NoBackoff
from redis.retry import Retry

from hybridserve.cache.block_pool import BlockHash
from hybridserve.cache.tier_store import (
    FORMAT_VERSION,
    HEADER,
    MAGIC,
    Payload,
    PutResult,
    TierStoreStats,
    _cuda_copy_stream,
    _object_bytes,
    _on_host,
    decode_payload,
    encode_payload,
)
from hybridserve.cache.tiers import KV, STATE, DiscoveryQuery, JointEntry, object_key
from hybridserve.config import check_remote_cache_url, redact_url

logger = logging.getLogger(__name__)

REMOTE = "remote"
SOCKET_TIMEOUT_S = 2.0      # one command's bound: a hung server delays the mover thread this long at most
CONNECT_TIMEOUT_S = 1.0
RETRY_AFTER_S = 1.0         # after a connection failure, misses without trying the server for this long
ENTRY_MAGIC = b"HSENT1"
_ENTRY = struct.Struct("<6sQQ")  # magic, boundary tokens, tail tokens
LOOKUP_CANDIDATES = 4       # deepest candidate boundaries checked whole per discovery lookup
_ROOT = "root"


class RemoteStoreError(ValueError):
    """The remote cache store cannot be used at start-up (one line naming the URL and why)."""


class RemoteStore:
    """Objects in a Redis server shared by replicas, under the model fingerprint's namespace."""

    def __init__(self, url: str, fingerprint: str, *, device: torch.device | None = None,
                 model_id: str | None = None, key_id: str | None = None) -> None:
        check_remote_cache_url(url)
        self.tier = REMOTE
        self.url = redact_url(url)
        self.namespace = f"hs:{fingerprint}:"
        self._client = redis.Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT_S,
                                            socket_connect_timeout=CONNECT_TIMEOUT_S,
                                            retry=Retry(NoBackoff(), 0), retry_on_timeout=False)
        self._stream = _cuda_copy_stream(device)
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._outage = False
        self.generation = 0  # outages survived: the server may have lost its contents in each
        try:
            self._client.ping()
            self.budget_bytes = self._server_budget()
        except redis.RedisError as error:
            raise RemoteStoreError(f"remote cache store {self.url} is unreachable: {error}") from None
        self._stats = TierStoreStats(tier=self.tier, budget_bytes=self.budget_bytes)
        if model_id is not None:
            self._check_seed(model_id, key_id)

    # -- start-up -------------------------------------------------------------------------------

    def _server_budget(self) -> int:
        """The server's `maxmemory` (0 means unbounded: the logical books then bound themselves);
        a warning when the server will not evict on its own (it would refuse writes once full)."""
        try:
            config = self._client.config_get("maxmemory*")
        except redis.ResponseError:  # CONFIG disabled (a managed server)
            return 0
        budget = int(config.get("maxmemory") or 0)
        if not budget or not str(config.get("maxmemory-policy", "")).startswith("allkeys-"):
            logger.warning("remote cache store %s: set maxmemory and maxmemory-policy allkeys-lru, so the server "
                           "evicts old entries itself (now maxmemory=%s, policy=%s)", self.url, budget,
                           config.get("maxmemory-policy"))
        return budget

    def _check_seed(self, model_id: str, key_id: str | None) -> None:
        """Record this engine's block-hash key under the model (fingerprinted without it) and warn
        when the store holds the same model under another key: such replicas never share a hit."""
        registry = f"hs:seeds:{model_id}"
        self._client.sadd(registry, key_id or "unkeyed")
        others = {_text(m) for m in self._client.smembers(registry)} - {key_id or "unkeyed"}
        if others:
            logger.warning("remote cache store %s holds entries of this model under %d other block-hash seed(s); "
                           "replicas sharing a store must share --block-hash-seed, or they never share a hit",
                           self.url, len(others))

    # -- ObjectStore ----------------------------------------------------------------------------

    def put(self, key: str, payload: Mapping[str, torch.Tensor], ready: Any = None) -> PutResult:
        """Write `payload` under `key` (header + checksum); a store that is down is a counted
        failed write (`ok=False`)."""
        start = time.perf_counter()
        blob = _object_bytes(key, encode_payload(_on_host(payload, self._stream, ready)))
        if not self._call(lambda: self._client.set(self.namespace + key, blob)):
            with self._lock:
                self._stats.failed_writes += 1
            return PutResult(False, len(blob))
        with self._lock:
            self._stats.puts += 1
            self._stats.bytes += len(blob)  # bytes written (the server's own accounting holds the rest)
            self._stats.transfer_seconds += time.perf_counter() - start
        return PutResult(True, len(blob))

    def get(self, key: str) -> Payload | None:
        """The payload under `key`, verified; None (a counted miss) when absent, unreadable, or the
        store is down. A corrupt object is deleted."""
        start = time.perf_counter()
        with self._lock:
            self._stats.gets += 1
        blob = self._call(lambda: self._client.get(self.namespace + key))
        if not isinstance(blob, bytes):
            with self._lock:
                self._stats.misses += 1
                self._stats.missing_misses += blob is None
            return None
        payload = parse_object(key, blob)
        with self._lock:
            if payload is None:
                self._stats.misses += 1
                self._stats.corrupt_misses += 1
            else:
                self._stats.hits += 1
                self._stats.transfer_seconds += time.perf_counter() - start
        if payload is None:
            logger.warning("remote cache: object %s is corrupt; a miss (deleted)", key)
            self._call(lambda: self._client.delete(self.namespace + key))
        return payload

    def delete(self, key: str) -> bool:
        """Drop `key` from the shared store; whether it was there."""
        return bool(self._call(lambda: self._client.delete(self.namespace + key)))

    def contains(self, key: str) -> bool:
        """Whether the server holds `key` now (False when it is down)."""
        return bool(self._call(lambda: self._client.exists(self.namespace + key)))

    def keys(self) -> list[str]:
        """Every key of this namespace (a scan: for tests and tools, not the serving path)."""
        found = self._call(lambda: list(self._client.scan_iter(match=self.namespace + "*", count=1000)))
        return [_text(key)[len(self.namespace):] for key in found or []]

    def stats(self) -> TierStoreStats:
        """A copy of the counters (`bytes`: bytes written since start)."""
        with self._lock:
            return TierStoreStats(**asdict(self._stats))

    def close(self) -> None:
        """Close the connections (the objects stay for other replicas)."""
        self._client.close()

    # -- the index discovery reads ------------------------------------------------------------

    def publish_entry(self, entry: JointEntry) -> bool:
        """Index a joint entry (its marker, its tail length) once its state and every KV object of
        its prefix are in the store; False (nothing indexed) when one is missing or the store is down."""
        marker = _ENTRY.pack(ENTRY_MAGIC, entry.num_tokens, entry.tail_tokens)
        objects = [self._object(STATE, entry.key), *(self._object(KV, block) for block in dict.fromkeys(entry.blocks))]

        def write() -> bool:
            if self._client.exists(*objects) != len(objects):
                return False
            with self._client.pipeline(transaction=False) as pipe:
                pipe.set(self.namespace + f"entry-{entry.key.hex()}", marker)
                if entry.tail_tokens:
                    pipe.sadd(self._tails_key(entry.parent), entry.tail_tokens)
                pipe.execute()
            return True
        return bool(self._call(write))

    def find_entry(self, query: DiscoveryQuery) -> tuple[JointEntry | None, bool]:
        """(the deepest entry on `query`'s path whose marker, state and every KV object of its prefix
        are present, or None; whether the store answered). Each object is verified again when
        promoted. Two round trips: markers, states, KV and tail sets along the path, then the deepest
        candidates' remaining objects."""
        found = self._call(lambda: self._find_entry(query))
        return (None, False) if found is _FAILED else (found, True)

    def _find_entry(self, query: DiscoveryQuery) -> JointEntry | None:
        hashes, size = query.block_hashes, query.block_size
        depth = min(len(hashes), query.limit // size)
        with self._client.pipeline(transaction=False) as pipe:
            for block in hashes[:depth]:
                pipe.exists(self._object(KV, block))
                pipe.exists(self._object(STATE, block))
                pipe.get(self.namespace + f"entry-{block.hex()}")
            for blocks in range(depth + 1):
                pipe.smembers(self._tails_key(hashes[blocks - 1] if blocks else None))
            replies = pipe.execute()
        kv_prefix = 0
        while kv_prefix < depth and replies[3 * kv_prefix]:
            kv_prefix += 1
        candidates: list[tuple[int, int, int]] = []  # (tokens, full blocks, tail tokens)
        for blocks in range(1, kv_prefix + 1):
            state, marker = replies[3 * blocks - 2], replies[3 * blocks - 1]
            tokens = blocks * size
            if state and query.deeper_than < tokens <= query.limit and _marker_is(marker, tokens, 0):
                candidates.append((tokens, blocks, 0))
        for blocks in range(kv_prefix + 1):
            for member in replies[3 * depth + blocks]:
                tail = int(member)
                if 0 < tail < size and query.deeper_than < blocks * size + tail <= query.limit:
                    candidates.append((blocks * size + tail, blocks, tail))
        candidates.sort(reverse=True)
        return self._first_whole(query, candidates[:LOOKUP_CANDIDATES])

    def _first_whole(self, query: DiscoveryQuery, candidates: Sequence[tuple[int, int, int]]) -> JointEntry | None:
        """The first candidate whose objects are all present (block ends were checked already)."""
        entries = []
        with self._client.pipeline(transaction=False) as pipe:
            for tokens, blocks, tail in candidates:
                prefix = query.block_hashes[:blocks]
                if not tail:
                    entries.append(JointEntry(prefix[-1], tokens, prefix, 0))
                    pipe.exists(self._object(STATE, prefix[-1]))  # still there: the answer keeps its order
                    continue
                key = query.tail_key(blocks, tail)
                entries.append(JointEntry(key, tokens, (*prefix, key), tail))
                pipe.exists(self._object(STATE, key), self._object(KV, key))
            replies = pipe.execute()
        for entry, present in zip(entries, replies):
            whole = 2 if entry.tail_tokens else 1
            if present == whole:
                return entry
        return None

    # -- plumbing -------------------------------------------------------------------------------

    def _object(self, kind: str, block: BlockHash) -> str:
        return self.namespace + object_key(kind, block)

    def _tails_key(self, parent: BlockHash | None) -> str:
        return self.namespace + f"tails-{parent.hex() if parent else _ROOT}"

    def _call(self, command: Callable[[], Any]) -> Any:
        """Run one command (or pipeline); `_FAILED` when the store is down or fails (counted), and
        skip the server for `RETRY_AFTER_S` after a connection failure. The first success after an
        outage bumps `generation` (the engine then forgets its books of the store)."""
        if time.monotonic() < self._down_until:
            with self._lock:
                self._stats.errors += 1
            return _FAILED
        try:
            result = command()
        except (redis.ConnectionError, redis.TimeoutError) as error:
            with self._lock:
                self._stats.errors += 1
            self._down_until = time.monotonic() + RETRY_AFTER_S
            if not self._outage:
                self._outage = True
                logger.warning("remote cache store %s is unavailable (%s): misses until it returns", self.url, error)
            return _FAILED
        except redis.RedisError as error:
            with self._lock:
                self._stats.errors += 1
            logger.warning("remote cache store %s: %s", self.url, error)
            return _FAILED
        if self._outage:
            self._outage = False
            self.generation += 1
            logger.warning("remote cache store %s is back", self.url)
        return result


class _Failed:
    """The result of a command that failed (distinct from any reply; false, as a miss is)."""

    def __bool__(self) -> bool:
        return False


_FAILED = _Failed()


def parse_object(key: str, blob: bytes) -> Payload | None:
    """The payload of a stored value after checking its header, key, length and checksum; None when
    any check fails (or the payload does not parse)."""
    if len(blob) < HEADER.size:
        return None
    magic, version, key_length, payload_length, checksum = HEADER.unpack_from(blob)
    body = HEADER.size + key_length
    if magic != MAGIC or version != FORMAT_VERSION or len(blob) != body + payload_length:
        return None
    if blob[HEADER.size:body] != key.encode():
        return None
    data = blob[body:]
    if xxhash.xxh3_128_digest(data) != checksum:
        return None
    try:
        return decode_payload(data)
    except Exception:  # a payload whose checksum matches but does not parse
        return None


def _marker_is(marker: Any, num_tokens: int, tail_tokens: int) -> bool:
    """Whether an `entry-` marker names this boundary."""
    if not isinstance(marker, bytes) or len(marker) != _ENTRY.size:
        return False
    magic, tokens, tail = _ENTRY.unpack(marker)
    return bool(magic == ENTRY_MAGIC and tokens == num_tokens and tail == tail_tokens)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


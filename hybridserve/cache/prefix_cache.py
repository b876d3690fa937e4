"""Joint prefix lookup (a boundary is a hit only when its KV blocks AND its GDN snapshot exist) and
its hit/miss statistics; tensor-free."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

from hybridserve.cache.block_pool import BlockHash, BlockPool, HashAlgorithm, hash_tail
from hybridserve.cache.snapshots import SnapshotPool


class PrefixHit(NamedTuple):
    """Restore `num_tokens` (0: a cold start) from these blocks and that snapshot slot; a boundary
    inside a block also names the cached partial block (`tail_block`) to copy on write."""

    num_tokens: int
    block_ids: list[int]
    snapshot_slot: int | None
    tail_block: int | None = None


class PrefixLookup(NamedTuple):
    """A lookup's outcome: the hit (possibly cold), its snapshot key, and what else was found."""

    hit: PrefixHit
    key: BlockHash | None
    num_tokens: int
    kv_match_tokens: int      # full blocks present in the block index, in tokens
    kv_only_miss: bool        # a deeper boundary had all its KV blocks but no snapshot
    snapshot_only_miss: bool  # a deeper boundary had a snapshot but not all its KV blocks


class PrefixCacheStats(NamedTuple):
    """Counters of the joint prefix cache since start-up."""

    queries: int
    query_tokens: int
    hits: int
    hit_tokens: int
    kv_only_misses: int
    snapshot_only_misses: int


class PrefixCache:
    """Joint lookup over a `BlockPool` and a `SnapshotPool`, which key a boundary by the same block
    (or tail) hash."""

    def __init__(self, block_pool: BlockPool, snapshots: SnapshotPool, block_size: int) -> None:
        self.block_pool = block_pool
        self.snapshots = snapshots
        self.block_size = block_size
        self._queries = self._query_tokens = self._hits = self._hit_tokens = 0
        self._kv_only = self._snapshot_only = 0

    def lookup(self, block_hashes: list[BlockHash], token_ids: Sequence[int], extra_keys: tuple[object, ...],
               algorithm: HashAlgorithm = "xxh3_128") -> PrefixLookup:
        """Deepest boundary b <= len(token_ids) - 1 whose KV and snapshot are both present, trying
        tails inside block j + 1, then the end of block j, for j from the KV match down. Pure:
        `record` it once the request is admitted, so retries do not inflate the stats."""
        num_tokens, size = len(token_ids), self.block_size
        cached = self.block_pool.longest_cached_prefix(block_hashes)
        limit = num_tokens - 1  # one token is always computed, for logits
        snapshot_only = any(self.snapshots.lookup(h) is not None
                            for h in block_hashes[len(cached):limit // size])
        for blocks in range(len(cached), -1, -1):
            parent = block_hashes[blocks - 1] if blocks else None
            hit = self._tail_hit(parent, blocks, token_ids, (extra_keys, algorithm), limit, cached)
            if hit is None and 0 < blocks * size <= limit:
                slot = self.snapshots.lookup(block_hashes[blocks - 1])
                if slot is not None:
                    hit = (PrefixHit(blocks * size, cached[:blocks], slot), block_hashes[blocks - 1])
            if hit is not None:
                kv_only = len(cached) * size > hit[0].num_tokens
                return PrefixLookup(hit[0], hit[1], num_tokens, len(cached) * size, kv_only, snapshot_only)
        return PrefixLookup(PrefixHit(0, [], None), None, num_tokens, len(cached) * size, bool(cached), snapshot_only)

    def boundaries_beyond(self, block_hashes: list[BlockHash], token_ids: Sequence[int],
                          extra_keys: tuple[object, ...], depth: int, kv_match_tokens: int,
                          algorithm: HashAlgorithm = "xxh3_128") -> Iterator[BlockHash]:
        """Keys of the boundaries deeper than `depth` (and <= len(token_ids) - 1) whose KV is cached,
        deepest first, in `lookup`'s order: cached tails inside block j + 1, then the end of block j
        (`kv_match_tokens`: the full blocks cached, as `lookup` found them)."""
        size, limit = self.block_size, len(token_ids) - 1
        for blocks in range(kv_match_tokens // size, -1, -1):
            first = blocks * size
            if first + size <= depth:
                return
            parent = block_hashes[blocks - 1] if blocks else None
            tails = self.block_pool.tails_after(parent)
            for length in sorted(set(tails.values()), reverse=True):
                if depth < first + length <= limit:
                    tail = hash_tail(parent, token_ids[first:first + length], extra_keys, algorithm)
                    if tail in tails:
                        yield tail
            if depth < first <= limit:
                yield block_hashes[blocks - 1]

    def _tail_hit(self, parent: BlockHash | None, blocks: int, token_ids: Sequence[int],
                  keys: tuple[tuple[object, ...], HashAlgorithm], limit: int,
                  cached: list[int]) -> tuple[PrefixHit, BlockHash] | None:
        """The deepest cached tail after `blocks` full blocks that matches and has a snapshot
        (`keys`: the request's extra hash keys and hash algorithm)."""
        tails = self.block_pool.tails_after(parent)
        if not tails:
            return None
        first = blocks * self.block_size
        for length in sorted(set(tails.values()), reverse=True):
            if first + length > limit:
                continue
            tail = hash_tail(parent, token_ids[first:first + length], *keys)
            slot = self.snapshots.lookup(tail) if tail in tails else None
            if slot is not None:
                return PrefixHit(first + length, cached[:blocks], slot, self.block_pool.lookup(tail)), tail
        return None

    def record(self, result: PrefixLookup) -> None:
        """Count an admitted lookup and note a hit on the snapshot it uses."""
        self._queries += 1
        self._query_tokens += result.num_tokens
        self._kv_only += result.kv_only_miss
        self._snapshot_only += result.snapshot_only_miss
        if result.key is not None:
            self.snapshots.record_hit(result.key)
            self._hits += 1
            self._hit_tokens += result.hit.num_tokens

    def stats(self) -> PrefixCacheStats:
        """Counters since start-up."""
        return PrefixCacheStats(self._queries, self._query_tokens, self._hits, self._hit_tokens,
                                self._kv_only, self._snapshot_only)

"""Joint prefix lookup: a boundary is a hit only when its KV blocks AND its GDN snapshot exist.

Tensor-free: it decides which boundary to restore from the block pool's hash index and the
snapshot pool's key index, and keeps the hit/miss statistics. Copying state is the runner's job.
"""

from __future__ import annotations

from typing import NamedTuple

from hybridserve.cache.block_pool import BlockHash, BlockPool
from hybridserve.cache.snapshots import SnapshotPool


class PrefixHit(NamedTuple):
    """Result of a joint lookup: restore `num_tokens` from these blocks and that snapshot slot.
    `num_tokens == 0` is a cold start (no blocks, no snapshot)."""

    num_tokens: int
    block_ids: list[int]
    snapshot_slot: int | None


class PrefixLookup(NamedTuple):
    """A lookup's outcome: the hit (possibly cold), its snapshot key, and deeper partial candidates."""

    hit: PrefixHit
    key: BlockHash | None
    num_tokens: int
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


def eligible_boundaries(num_tokens: int, interval: int) -> list[int]:
    """Snapshot boundaries a request of `num_tokens` tokens may restore, deepest first.
    At least one token is always computed (to produce logits), so b <= num_tokens - 1."""
    return list(range(((num_tokens - 1) // interval) * interval, 0, -interval))


class PrefixCache:
    """Joint lookup over a `BlockPool` and a `SnapshotPool` keyed by the boundary's block hash."""

    def __init__(self, block_pool: BlockPool, snapshots: SnapshotPool, block_size: int, interval: int) -> None:
        self.block_pool = block_pool
        self.snapshots = snapshots
        self.block_size = block_size
        self.interval = interval
        self._queries = self._query_tokens = self._hits = self._hit_tokens = 0
        self._kv_only = self._snapshot_only = 0

    def lookup(self, block_hashes: list[BlockHash], num_tokens: int) -> PrefixLookup:
        """Deepest boundary b <= num_tokens - 1 whose KV blocks and snapshot are both present.

        `block_hashes` are the hashes of the request's full blocks. Candidates that have only
        KV or only a snapshot are noted as misses of that kind and never returned. Pure: call
        `record` once the request is actually admitted, so retries do not inflate the stats.
        """
        cached_blocks = self.block_pool.longest_cached_prefix(block_hashes)
        kv_only = snapshot_only = False
        for boundary in eligible_boundaries(num_tokens, self.interval):
            num_blocks = boundary // self.block_size
            slot = self.snapshots.lookup(block_hashes[num_blocks - 1])
            kv_present = num_blocks <= len(cached_blocks)
            if kv_present and slot is not None:
                hit = PrefixHit(boundary, cached_blocks[:num_blocks], slot)
                return PrefixLookup(hit, block_hashes[num_blocks - 1], num_tokens, kv_only, snapshot_only)
            kv_only |= kv_present
            snapshot_only |= slot is not None
        return PrefixLookup(PrefixHit(0, [], None), None, num_tokens, kv_only, snapshot_only)

    def record(self, result: PrefixLookup) -> None:
        """Count an admitted lookup and refresh the LRU position of the snapshot it uses."""
        self._queries += 1
        self._query_tokens += result.num_tokens
        self._kv_only += result.kv_only_miss
        self._snapshot_only += result.snapshot_only_miss
        if result.key is not None:
            self.snapshots.touch(result.key)
            self._hits += 1
            self._hit_tokens += result.hit.num_tokens

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._queries, self._query_tokens, self._hits, self._hit_tokens,
                                self._kv_only, self._snapshot_only)

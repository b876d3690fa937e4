"""hybridserve's eviction values an unproven snapshot at the restores per published snapshot the pool
has seen (at most one), so with rare restores a shallow snapshot that serves outlives deep guesses."""

from __future__ import annotations

from hybridserve.cache.block_pool import BlockPool
from hybridserve.cache.policy import PrefixCost, make_policy
from hybridserve.cache.snapshots import SnapshotPool

COST = PrefixCost(1.0e6, 1.0, 64, 1000)  # linear work dominates, as in real shapes


def _pool_with(num_deep: int, restores_of_shallow: int) -> tuple[SnapshotPool, int]:
    """A pool holding one shallow snapshot (restored `restores_of_shallow` times), then `num_deep`
    deep ones never restored; the shallow one's slot."""
    policy = make_policy("hybridserve", 16, COST, 0)
    policy.kv_present = lambda key: True  # type: ignore[method-assign]
    pool = SnapshotPool(num_deep + 1)
    policy.bind(BlockPool(8), pool)
    shallow = pool.reserve(b"shallow", 64)
    pool.publish(shallow)
    for _ in range(restores_of_shallow):
        pool.record_hit(b"shallow")
    for index in range(num_deep):
        pool.publish(pool.reserve(f"deep{index}".encode(), 1024))
    assert shallow.slot is not None
    return pool, shallow.slot


def test_rare_restores_keep_the_shallow_snapshot_that_serves() -> None:
    pool, shallow = _pool_with(num_deep=30, restores_of_shallow=2)
    assert pool.choose_victim is not None and pool.choose_victim(pool) != shallow


def test_when_every_snapshot_is_restored_depth_still_counts() -> None:
    """Restores as common as snapshots: an unproven deep one is worth a full restore, and saves
    far more than the shallow one with its two."""
    pool, shallow = _pool_with(num_deep=1, restores_of_shallow=2)
    assert pool.choose_victim is not None and pool.choose_victim(pool) == shallow

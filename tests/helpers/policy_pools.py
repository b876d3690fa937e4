"""The default cache policy bound to a bare snapshot pool (KV always present), and publishing into it
as the cache manager does: for unit tests of what the policy learns and evicts."""

from __future__ import annotations

from hybridserve.cache.block_pool import BlockHash, BlockPool
from hybridserve.cache.policy import HybridServePolicy, PrefixCost, make_policy
from hybridserve.cache.snapshots import ReserveStatus, SnapshotPool

COST = PrefixCost(1.0e6, 1.0, 64, 1000)


def policy_and_pool(num_slots: int) -> tuple[HybridServePolicy, SnapshotPool, dict[BlockHash, str]]:
    """A `hybridserve` policy bound to a pool of `num_slots` and to the kinds map it reads."""
    policy = make_policy("hybridserve", 16, COST, 0)
    assert isinstance(policy, HybridServePolicy)
    policy.kv_present = lambda key: True  # type: ignore[method-assign]
    pool, kinds = SnapshotPool(num_slots), {}
    policy.bind(BlockPool(8), pool, kinds)
    return policy, pool, kinds


def publish(policy: HybridServePolicy, pool: SnapshotPool, kinds: dict[BlockHash, str], key: bytes,
            tokens: int, kind: str) -> int:
    """Reserve and publish `key` (`tokens` deep, of `kind`) and tell the policy; its slot."""
    reservation = pool.reserve(key, tokens, branch=kind == "branch")
    assert reservation.status is ReserveStatus.RESERVED and reservation.slot is not None
    kinds[key] = kind
    pool.publish(reservation)
    policy.observe_publish(kind, key)
    return reservation.slot

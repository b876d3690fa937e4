"""The default cache policy bound to a bare snapshot pool (KV always present), and publishing into it
as the cache manager does: for unit tests of what the policy learns and evicts."""

from __future__ import annotations

from hybridserve.cache.block_pool import BlockHash, BlockPool
from hybridserve.cache.policy import HybridServePolicy, PrefixCost, make_policy
from hybridserve.cache.snapshots import ReserveStatus, SnapshotPool
from hybridserve.sim.shapes import model_shape
from hybridserve.sim.simulator import AccountingRun, SimConfig

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


def replay_with_default(num_slots: int, interval: int) -> tuple[AccountingRun, HybridServePolicy]:
    """A simulator replay of the built-in model's shape under `hybridserve` (`num_slots` snapshot
    slots, block 16, KV plenty) and its policy: for tests of what the manager reports to it."""
    shape = model_shape("builtin")
    run = AccountingRun(SimConfig("hybridserve", 1 << 34, num_slots * shape.cost.snapshot_bytes, 16, interval), shape)
    policy = run.cache.policy
    assert isinstance(policy, HybridServePolicy)
    return run, policy

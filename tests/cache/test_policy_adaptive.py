"""The adaptive policy (`hybridserve-adaptive`) learns: restore rates per candidate kind (a kind never restored loses
value and stops displacing useful snapshots; a restored one gains), ghosts of evicted snapshots move
the age horizon, and replays stay deterministic."""

from __future__ import annotations

from hybridserve.cache.block_pool import BlockPool
from hybridserve.cache.policy import (
    AdaptiveHybridServePolicy,
    PrefixCost,
    RequestView,
    RestoreRates,
    make_policy,
)
from hybridserve.cache.snapshots import ReserveStatus, SnapshotPool
from hybridserve.config import POLICY_NAMES
from hybridserve.sim.shapes import model_shape
from hybridserve.sim.simulator import SimConfig, simulate
from hybridserve.sim.trace import TraceTokens
from hybridserve.sim.workloads import workload_records

COST = PrefixCost(1e9, 1e3, 1024, 1 << 20)
BLOCK = 16


def test_adaptive_policy_is_selectable_beside_the_default() -> None:
    assert POLICY_NAMES[0] == "hybridserve" and "hybridserve-adaptive" in POLICY_NAMES
    assert isinstance(make_policy("hybridserve-adaptive", BLOCK, COST, 256), AdaptiveHybridServePolicy)
    assert not isinstance(make_policy("hybridserve", BLOCK, COST, 256), AdaptiveHybridServePolicy)


def test_rates_start_even_and_follow_evidence() -> None:
    rates = RestoreRates()
    assert rates.relative("prompt", 512) == 1.0 and rates.relative("interval", 512) == 0.5
    for _ in range(50):
        rates.observe("branch", 512, 0.0)
        rates.observe("end", 512, 2.0)
    assert rates.relative("branch", 512) < 0.2 < 1.0 < rates.relative("end", 512)
    assert rates.relative("end", 1 << 20) > 1.0      # an unseen depth leans on its kind


def _published(pool: SnapshotPool, policy: AdaptiveHybridServePolicy, name: bytes, view: RequestView,
               boundary: int) -> bytes | None:
    """Capture `boundary` for `view` as the manager does: ask the policy, reserve, publish (None:
    an opportunistic capture found no free or covered slot)."""
    assert boundary in policy.captures(view, boundary - BLOCK, BLOCK)
    key = name * 16
    opportunistic = policy.is_opportunistic(view, boundary)
    reservation = pool.reserve(key, boundary, opportunistic=opportunistic)
    if reservation.status is ReserveStatus.SKIPPED and opportunistic:
        return None
    assert reservation.status is ReserveStatus.RESERVED
    pool.publish(reservation)
    return key


def _bound_policy(slots: int) -> tuple[SnapshotPool, AdaptiveHybridServePolicy]:
    policy = make_policy("hybridserve-adaptive", BLOCK, COST, 256)
    assert isinstance(policy, AdaptiveHybridServePolicy)
    pool = SnapshotPool(slots)
    policy.bind(BlockPool(8), pool)
    return pool, policy


def test_a_kind_never_restored_loses_value_and_a_restored_one_gains() -> None:
    pool, policy = _bound_policy(4)
    branch_view = RequestView(num_prompt_tokens=1000, num_tokens=1000, branch_point=320, deepest_snapshot=0)
    prompt_view = RequestView(num_prompt_tokens=1000, num_tokens=1000, branch_point=0, deepest_snapshot=0)
    assert not policy.is_opportunistic(branch_view, 320)
    for index in range(60):
        view, boundary = (branch_view, 320) if index % 2 else (prompt_view, 992)
        key = _published(pool, policy, bytes([index]), view, boundary)
        if key is not None and boundary == 992:
            policy.evict_kv_first(view)                 # the next call into the policy learns the key
            pool.record_hit(key)
            pool.record_hit(key)
    assert policy.rates.relative("branch", 320) < 1.0 < policy.rates.relative("prompt", 992)
    assert policy.is_opportunistic(branch_view, 320)   # no longer pushes out a useful snapshot
    assert not policy.is_opportunistic(prompt_view, 992)
    pool.check_integrity()


def test_a_ghost_captured_again_counts_as_a_late_restore_and_moves_the_horizon() -> None:
    pool, policy = _bound_policy(2)
    view = RequestView(num_prompt_tokens=1000, num_tokens=1000, branch_point=0, deepest_snapshot=0)
    first = _published(pool, policy, b"a", view, 992)
    assert first is not None
    policy.evict_kv_first(view)
    for name in (b"b", b"c"):                           # two more: the first is evicted
        _published(pool, policy, name, view, 992)
        policy.evict_kv_first(view)
    assert pool.lookup(first) is None
    before, horizon = policy.rates.rate("prompt", 992), policy.horizon
    _published(pool, policy, b"a", view, 992)           # the same state computed again
    policy.evict_kv_first(view)
    assert policy.rates.rate("prompt", 992) > before
    assert policy.horizon != horizon
    pool.check_integrity()


def test_adaptive_replay_is_deterministic() -> None:
    shape = model_shape("builtin")
    config = SimConfig("hybridserve-adaptive", 4096 * BLOCK * shape.cost.kv_bytes_per_token,
                       6 * shape.cost.snapshot_bytes, BLOCK, 32)

    def replay() -> tuple[int, ...]:
        tokens = TraceTokens(workload_records("agent", 80, 16, seed=1), 16, shape.config.vocab_size)
        return simulate(tokens, shape, config, check=True).hits

    hits = replay()
    assert sum(hits) > 0 and hits == replay()

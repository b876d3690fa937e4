"""The joint cache manager: the scheduler's only door to cache state (tensor-free unit tests)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from hybridserve.cache.block_pool import BlockPool
from hybridserve.cache.manager import JointCacheManager
from hybridserve.cache.policy import PrefixCost, make_policy
from hybridserve.cache.snapshots import SnapshotPool
from hybridserve.cache.state_slots import StateSlotPool
from hybridserve.config import SchedulerConfig
from hybridserve.engine.request import Request
from hybridserve.engine.scheduler import Scheduler
from hybridserve.sampling_params import SamplingParams

BLOCK = 16
COST = PrefixCost(1.0e6, 1.0, 2048, 1 << 20)
PACKAGE = Path(__file__).resolve().parents[2] / "hybridserve"


def _manager(blocks: int = 64, slots: int = 4, snapshots: int = 8, policy: str = "interval") -> JointCacheManager:
    pool = SnapshotPool(snapshots) if snapshots else None
    return JointCacheManager(BLOCK, BlockPool(blocks), StateSlotPool(slots), pool,
                             make_policy(policy, BLOCK, COST, 32) if pool else None)


def _request(name: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(name, None, tokens, SamplingParams(max_tokens=4, ignore_eos=True), cache_salt=salt)


def _serve(scheduler: Scheduler, request: Request, outputs: list[int]) -> None:
    """Admit and prefill, then decode `outputs` one step each, then finish."""
    scheduler.add(request)
    scheduler.apply(scheduler.schedule(), set())
    for token in outputs[:-1]:
        request.append_token(token)
        scheduler.apply(scheduler.schedule(), set())
    request.append_token(outputs[-1])
    capture = scheduler.finish(request, "length")
    if capture is not None:
        scheduler.complete_end_capture(capture, True)
    scheduler.check_integrity()


def test_second_turn_restores_the_first_turns_end() -> None:
    """A request end is a joint boundary: the next turn restores exactly there."""
    manager = _manager(policy="hybridserve")
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_prefill_tokens_during_decode=0), manager)
    first = _request("a", list(range(100, 150)))
    _serve(scheduler, first, [7, 8, 9])
    follow = _request("b", first.token_ids + [11, 12, 13])
    scheduler.add(follow)
    output = scheduler.schedule()
    (restore,) = output.restores
    assert restore.num_tokens == len(first.token_ids) - 1 and restore.snapshot_slot is not None
    assert restore.kv_copy is not None  # the end falls inside a block: copy-on-write of the tail
    scheduler.apply(output, set())
    assert follow.num_cached_tokens == len(first.token_ids) - 1
    scheduler.finish(follow, "abort")
    scheduler.check_integrity()
    assert manager.usage().kv_blocks_used == 0 and manager.usage().snapshots_pinned == 0


def test_kv_without_a_snapshot_is_not_a_hit() -> None:
    """Evicting the snapshot of a cached prefix leaves its KV, which alone must not be used."""
    manager = _manager(policy="interval")
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_prefill_tokens_during_decode=0), manager)
    prompt = list(range(200, 264))
    _serve(scheduler, _request("a", prompt), [1])
    assert manager.snapshots is not None and manager.snapshots.clear() > 0
    again = _request("b", prompt + [5])
    scheduler.add(again)
    output = scheduler.schedule()
    assert output.restores[0].num_tokens == 0 and output.restores[0].snapshot_slot is None
    scheduler.apply(output, set())
    scheduler.finish(again, "abort")
    assert manager.prefix_stats().kv_only_misses == 1
    scheduler.check_integrity()


def test_salts_share_nothing() -> None:
    manager = _manager(policy="interval")
    scheduler = Scheduler(SchedulerConfig(max_prefill_tokens_during_decode=0), manager)
    prompt = list(range(300, 370))
    _serve(scheduler, _request("a", prompt, salt="tenant-1"), [1])
    other = _request("b", prompt, salt="tenant-2")
    assert manager.block_hashes(other, 2) != manager.block_hashes(_request("c", prompt, salt="tenant-1"), 2)
    scheduler.add(other)
    output = scheduler.schedule()
    assert output.restores[0].num_tokens == 0
    scheduler.revert(output)
    scheduler.finish(other, "abort")
    scheduler.check_integrity()


def test_revert_gives_back_everything_the_step_took() -> None:
    manager = _manager(policy="interval")
    scheduler = Scheduler(SchedulerConfig(max_prefill_tokens_during_decode=0), manager)
    prompt = list(range(400, 480))
    _serve(scheduler, _request("warm", prompt), [1])
    before = manager.usage(), manager.snapshot_stats().published
    request = _request("hit", prompt + list(range(20)))
    scheduler.add(request)
    output = scheduler.schedule()
    assert output.restores[0].snapshot_slot is not None and output.chunks[0].captures
    scheduler.revert(output)
    assert (manager.usage(), manager.snapshot_stats().published) == before
    assert list(scheduler.waiting) == [request] and request.failed_steps == 1
    scheduler.check_integrity()
    scheduler.apply(scheduler.schedule(), set())  # and it runs afterwards
    scheduler.finish(request, "abort")
    scheduler.check_integrity()


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    manager = _manager(policy="interval")
    scheduler = Scheduler(SchedulerConfig(max_prefill_tokens_during_decode=0), manager)
    prompt = list(range(500, 540))  # 2 full blocks + 8 tokens
    parent, child = _request("p", prompt), _request("p", prompt)
    scheduler.add(parent)
    scheduler.apply(scheduler.schedule(), set())
    fork = scheduler.fork(parent, child)
    assert fork is not None and fork.src_block is not None and fork.dst_block is not None
    assert manager.block_table(child)[:2] == manager.block_table(parent)[:2]
    assert manager.block_table(child)[2] != manager.block_table(parent)[2]
    assert manager.state_slot(child) != manager.state_slot(parent)
    scheduler.check_integrity()
    for request in (parent, child):
        scheduler.finish(request, "abort")
    scheduler.check_integrity()
    assert manager.usage().kv_blocks_used == 0


def test_preemption_releases_and_keeps_the_record() -> None:
    """A preempted request holds nothing while waiting; its lookup is counted once overall."""
    manager = _manager(blocks=6, policy="interval")
    scheduler = Scheduler(SchedulerConfig(max_prefill_tokens_during_decode=0), manager)
    first, second = _request("a", list(range(40))), _request("b", list(range(100, 140)))
    scheduler.add(first)
    scheduler.add(second)
    scheduler.apply(scheduler.schedule(), set())
    for token in range(30):  # both decode until the pool runs out and the newest is preempted
        for request in list(scheduler.running):
            request.append_token(token)
        scheduler.apply(scheduler.schedule(), set())
        if scheduler.num_preemptions:
            break
    assert scheduler.num_preemptions == 1 and not manager.holds_resources(second)
    scheduler.check_integrity()
    for request in (first, second):
        scheduler.finish(request, "abort")
    scheduler.check_integrity()
    assert manager.prefix_stats().queries == 2


def test_finish_releases_even_when_the_end_capture_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    manager = _manager(policy="hybridserve")
    scheduler = Scheduler(SchedulerConfig(max_prefill_tokens_during_decode=0), manager)
    request = _request("a", list(range(600, 650)))
    scheduler.add(request)
    scheduler.apply(scheduler.schedule(), set())
    assert manager.snapshots is not None

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(manager.snapshots, "reserve", broken)
    with pytest.raises(RuntimeError, match="injected"):
        scheduler.finish(request, "length")
    assert not scheduler.running and manager.usage().kv_blocks_used == 0
    assert manager.usage().state_slots_free == manager.usage().state_slots


def test_a_record_that_outlives_its_request_is_caught() -> None:
    manager = _manager(policy="interval")
    scheduler = Scheduler(SchedulerConfig(), manager)
    request = _request("a", list(range(40)))
    scheduler.add(request)
    scheduler.apply(scheduler.schedule(), set())
    scheduler.running.remove(request)  # a scheduler bug: dropped without releasing
    with pytest.raises(AssertionError):
        scheduler.check_integrity()


def test_disabled_prefix_cache_still_manages_blocks_and_slots() -> None:
    manager = _manager(snapshots=0)
    assert not manager.enabled
    scheduler = Scheduler(SchedulerConfig(), manager)
    _serve(scheduler, _request("a", list(range(50))), [1, 2])
    assert manager.prefix_stats().queries == 0 and manager.usage().kv_blocks_used == 0


def test_a_prefix_cache_needs_a_policy() -> None:
    with pytest.raises(ValueError, match="policy"):
        JointCacheManager(BLOCK, BlockPool(4), StateSlotPool(1), SnapshotPool(2), None)


def test_scheduler_imports_no_pool_class() -> None:
    """The scheduler reaches cache state only through the manager."""
    tree = ast.parse((PACKAGE / "engine" / "scheduler.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not imported & {"BlockPool", "SnapshotPool", "StateSlotPool", "PrefixCache", "CachePolicy"}
    assert not modules & {"hybridserve.cache.block_pool", "hybridserve.cache.prefix_cache",
                          "hybridserve.cache.policy", "hybridserve.cache.state_slots"}


def test_request_carries_no_cache_bookkeeping() -> None:
    names = {field.name for field in dataclasses.fields(Request)}
    assert not names & {"block_ids", "state_slot", "num_registered_blocks", "branch_point", "snapshot_depth",
                        "snapshot_key", "prefix_lookup_counted", "block_size", "block_hash"}


def test_forget_refuses_a_sequence_that_holds_resources() -> None:
    manager = _manager(policy="interval")
    scheduler = Scheduler(SchedulerConfig(), manager)
    request = _request("a", list(range(40)))
    scheduler.add(request)
    scheduler.apply(scheduler.schedule(), set())
    with pytest.raises(RuntimeError, match="holds cache resources"):
        manager.forget(request)
    scheduler.finish(request, "abort")
    scheduler.check_integrity()

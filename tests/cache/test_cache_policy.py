"""Cache policies: admission and eviction decisions on hand-built traces, request-end snapshots
inside a block, multi-turn chat on the live engine, and cache on == off for every policy."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.cache.block_pool import BlockPool
from hybridserve.cache.policy import (
    KIND_HALF_LIFE,
    RESTORES_COUNTED,
    HybridServePolicy,
    KindRates,
    PrefixCost,
    RequestView,
    make_policy,
)
from hybridserve.cache.snapshots import ReserveStatus, SnapshotPool
from hybridserve.config import POLICY_NAMES, CacheConfig
from hybridserve.sim.shapes import model_shape
from hybridserve.sim.simulator import AccountingRun, SimConfig

COST = PrefixCost(1e9, 1e3, 1024, 1 << 20)
SHAPE = model_shape("builtin")


def _tokens(length: int, seed: int) -> list[int]:
    return torch.randint(300, 4096, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(policy: str, snapshot_slots: int, kv_blocks: int = 4096, block_size: int = 16,
         interval: int = 256) -> AccountingRun:
    return AccountingRun(SimConfig(policy, kv_blocks * block_size * SHAPE.cost.kv_bytes_per_token,
                                    snapshot_slots * SHAPE.cost.snapshot_bytes, block_size, interval), SHAPE)


# ------------------------------------------------------------------------- admission


def test_admission_boundaries_of_each_policy() -> None:
    view = RequestView(num_prompt_tokens=700, num_tokens=700, branch_point=320, deepest_snapshot=0)
    assert make_policy("interval", 16, COST, 256).captures(view, 0, 700) == [256, 512]
    assert make_policy("last-block", 16, COST, 256).captures(view, 0, 700) == [688]
    assert make_policy("marconi", 16, COST, 256).captures(view, 0, 700) == [320]
    hybrid = make_policy("hybridserve", 16, COST, 256)
    assert hybrid.captures(view, 0, 700) == [256, 320, 512, 688]
    assert hybrid.captures(view, 300, 100) == [320]            # only what this chunk computes
    assert [hybrid.is_opportunistic(view, b) for b in (256, 320, 512, 688)] == [True, False, True, False]
    assert make_policy("marconi", 16, COST, 256).capture_at_end and hybrid.capture_at_end
    assert not make_policy("interval", 16, COST, 256).capture_at_end
    with pytest.raises(ValueError, match="unknown cache policy"):
        make_policy("lru", 16, COST, 256)
    with pytest.raises(ValueError, match="unknown cache policy"):
        CacheConfig(cache_policy="nope")


def test_opportunistic_reservation_never_evicts_a_useful_snapshot() -> None:
    pool = SnapshotPool(2)
    for index in range(2):
        pool.publish(pool.reserve(bytes([index]) * 16, 16 * (index + 1)))
    assert pool.reserve(b"x" * 16, 48, opportunistic=True).status is ReserveStatus.SKIPPED
    child = pool.reserve(b"y" * 16, 64, parent=b"\x00" * 16)           # evicts the LRU (slot of key 0)
    assert child.status is ReserveStatus.RESERVED and pool.lookup(b"\x00" * 16) is None
    pool.publish(child)
    chained = pool.reserve(b"z" * 16, 80, parent=b"y" * 16)             # evicts key 1
    pool.publish(chained)
    assert list(pool.covered()) == [pool.lookup(b"y" * 16)]             # y: one child, never hit
    assert pool.reserve(b"w" * 16, 96, opportunistic=True).status is ReserveStatus.RESERVED  # takes y
    pool.check_integrity()


def test_branch_flag_counts_the_older_path() -> None:
    pool = SnapshotPool(4)
    pool.publish(pool.reserve(b"a" * 16, 256))
    pool.publish(pool.reserve(b"b" * 16, 512, parent=b"a" * 16))
    assert list(pool.covered()) == [pool.lookup(b"a" * 16)]
    assert pool.reserve(b"a" * 16, 256, branch=True).status is ReserveStatus.DUPLICATE
    assert list(pool.covered()) == [] and pool.paths(pool.lookup(b"a" * 16)) == 2
    pool.check_integrity()


def test_previous_turn_end_is_covered_once_the_next_turn_continues_it() -> None:
    """A chat turn's end, restored once by the next turn whose own end is now in, serves nothing
    the deeper end does not: it is evicted first. Restored twice, or a branch, it is kept."""
    pool = SnapshotPool(4)
    pool.publish(pool.reserve(b"1" * 16, 300))                           # turn 1's end
    pool.record_hit(b"1" * 16)                                           # turn 2 restores it ...
    pool.publish(pool.reserve(b"2" * 16, 700, parent=b"1" * 16))         # ... and ends deeper
    assert list(pool.covered()) == [pool.lookup(b"1" * 16)]
    pool.publish(pool.reserve(b"x" * 16, 200))                           # an unrelated request
    pool.publish(pool.reserve(b"y" * 16, 250))
    pool.touch(b"2" * 16)
    victim = pool.reserve(b"z" * 16, 900, opportunistic=True)            # only a covered slot may go
    assert victim.status is ReserveStatus.RESERVED and victim.evicted_key == b"1" * 16
    pool.abort(victim)
    pool.publish(pool.reserve(b"3" * 16, 1100, parent=b"2" * 16))
    pool.record_hit(b"2" * 16)
    pool.record_hit(b"2" * 16)                                           # restored twice: a reuse point
    assert pool.lookup(b"2" * 16) not in set(pool.covered())
    pool.check_integrity()


# ------------------------------------------------------------------- hand-built traces


def test_kind_rates_start_at_one_restore_and_follow_evidence() -> None:
    rates = KindRates()
    assert rates.rate("branch") == rates.rate("end") == 1.0                   # the benefit of the doubt
    for _ in range(24):
        rates.published("branch")
        rates.published("end")
        rates.restored("end", 0)
    assert rates.rate("branch") == pytest.approx(8 / 32, rel=0.02)
    assert rates.rate("end") == pytest.approx(1.0, rel=0.02)
    for earlier in range(10):                                              # one hot snapshot ...
        rates.restored("prompt", earlier)
    rates.published("prompt")
    assert rates.rate("prompt") == pytest.approx((RESTORES_COUNTED + 8) / 9, rel=0.02)   # ... counts a few
    low = rates.rate("branch")
    for _ in range(int(KIND_HALF_LIFE)):                                   # evidence fades with publications
        rates.published("end")
    assert low < rates.rate("branch") < 1.0


def test_default_admission_learns_which_kinds_may_push_out_request_ends() -> None:
    """Branch points and prompt marks may evict while their kind is restored as often as request
    ends; a kind restored less per snapshot takes free or covered slots only."""
    policy = make_policy("hybridserve", 16, COST, 256)
    assert isinstance(policy, HybridServePolicy)
    view = RequestView(num_prompt_tokens=700, num_tokens=700, branch_point=320, deepest_snapshot=0)
    assert not policy.is_opportunistic(view, 320) and not policy.is_opportunistic(view, 688)
    for _ in range(40):
        policy.observe_publish("branch", b"k" * 16)
        policy.observe_publish("end", b"k" * 16)
        policy.observe_restore("end", 0, b"k" * 16)
    assert policy.is_opportunistic(view, 320)             # continuations nobody returns to
    assert not policy.is_opportunistic(view, 688)         # no evidence on prompt marks yet
    for _ in range(40):
        policy.observe_publish("prompt", b"k" * 16)
        policy.observe_restore("prompt", 0, b"k" * 16)
        policy.observe_restore("prompt", 1, b"k" * 16)
    assert not policy.is_opportunistic(view, 688)         # restored more than ends: it may evict
    assert policy.is_opportunistic(view, 256)             # interval marks never evict


def test_manager_reports_publications_and_restores_by_kind() -> None:
    run = _run("hybridserve", snapshot_slots=16)
    policy = run.cache.policy
    assert isinstance(policy, HybridServePolicy)
    prompt, output = _tokens(100, 31), _tokens(5, 32)
    run.serve("a", prompt, output)                                       # publishes its prompt mark and end
    assert run.serve("b", prompt + output + _tokens(20, 33), _tokens(3, 34)) == 104
    end_restores, end_publications = policy.kind_rates.evidence("end")
    prompt_restores, prompt_publications = policy.kind_rates.evidence("prompt")
    assert end_restores == pytest.approx(1.0, rel=0.01) and end_publications == pytest.approx(2.0, rel=0.01)
    assert prompt_restores == 0.0 and prompt_publications == pytest.approx(2.0, rel=0.01)
    run.scheduler.check_integrity()




def _evict_all_snapshots(run: AccountingRun) -> None:
    """Drop every device snapshot through the manager's eviction path, keeping the KV cached."""
    for slot in list(run.snapshots.evictable()):
        key = run.snapshots.key_of(slot)
        run.cache._on_block_evicted(key)
        assert run.snapshots.lookup(key) is None


def test_a_continuation_past_an_evicted_end_is_a_resume_not_a_branch() -> None:
    """Where the KV match ends at an earlier request's cached end tail, the request continues that
    request ("resume"); where another path's blocks diverge, it is a branch point."""
    run = _run("hybridserve", snapshot_slots=16)
    policy = run.cache.policy
    assert isinstance(policy, HybridServePolicy)
    prompt, output = _tokens(100, 41), _tokens(5, 42)
    run.serve("a", prompt, output)                                       # end tail: tokens 96..104
    _evict_all_snapshots(run)
    assert run.serve("b", prompt + output + _tokens(20, 43), _tokens(3, 44)) == 0
    assert policy.kind_rates.evidence("resume")[1] == pytest.approx(1.0, rel=0.01)
    assert policy.kind_rates.evidence("branch")[1] == pytest.approx(1.0, rel=0.01)   # pooled for admission
    _evict_all_snapshots(run)
    assert run.serve("c", prompt[:96] + _tokens(30, 45), _tokens(3, 46)) == 0       # diverges at 96
    assert policy.kind_rates.evidence("resume")[1] == pytest.approx(1.0, rel=0.01)
    assert policy.kind_rates.evidence("branch")[1] == pytest.approx(2.0, rel=0.01)
    run.scheduler.check_integrity()


def test_a_resume_is_covered_until_resumes_prove_worth_more_than_ends() -> None:
    policy = make_policy("hybridserve", 16, COST, 256)
    assert isinstance(policy, HybridServePolicy)
    policy.bind(BlockPool(64), SnapshotPool(8))
    branch = RequestView(num_prompt_tokens=700, num_tokens=700, branch_point=320, deepest_snapshot=0)
    resume = branch._replace(resumes=True)
    assert policy.holds_as_branch(branch, 320, b"k" * 16)                # a path beside the request's own
    assert not policy.holds_as_branch(branch, 256, b"k" * 16)            # not the branch point
    assert not policy.holds_as_branch(resume, 320, b"r0" * 8)            # starts at the ends' rate
    assert policy.kind_of(resume, 320) == "resume" and policy.kind_of(branch, 320) == "branch"
    for index in range(8):                                               # siblings: each wanted twice
        key = bytes([index]) * 16
        policy.observe_publish("resume", b"k" * 16)
        policy.observe_publish("end", b"k" * 16)
        policy.holds_as_branch(resume, 320, key)
        policy.holds_as_branch(resume, 320, key)
    restores, publications = policy.kind_rates.evidence("resume")
    assert restores == pytest.approx(8.0, rel=0.01) and publications == pytest.approx(8.0, rel=0.01)
    assert policy.holds_as_branch(resume, 320, b"r1" * 8)                # restored more than ends now
    for index in range(40):                                              # ends return, resumes do not
        policy.observe_publish("resume", b"k" * 16)
        policy.observe_publish("end", b"k" * 16)
        policy.observe_restore("end", 0, b"k" * 16)
    assert not policy.holds_as_branch(resume, 320, b"r2" * 8)


def test_request_end_inside_a_block_is_restored_exactly() -> None:
    run = _run("hybridserve", snapshot_slots=16)
    prompt, output = _tokens(100, 1), _tokens(5, 2)
    assert run.serve("a", prompt, output) == 0
    end = len(prompt) + len(output) - 1                                  # 104: inside block 6
    assert end % 16 == 8
    assert run.serve("b", prompt + output + _tokens(20, 3), _tokens(3, 4)) == end
    # A request that diverges inside the cached tail cannot use it; the prompt mark serves it.
    diverged = prompt + output[:2] + _tokens(30, 5)
    assert run.serve("c", diverged, _tokens(2, 6)) == 96
    run.scheduler.check_integrity()


def test_extending_a_tail_copies_it_and_leaves_it_intact() -> None:
    run = _run("hybridserve", snapshot_slots=16)
    prompt, output = _tokens(40, 7), _tokens(4, 8)
    run.serve("a", prompt, output)
    history = prompt + output[:-1]                                       # 43 computed tokens
    for index in range(3):                                               # siblings all hit the same tail
        assert run.serve(f"s{index}", history + _tokens(10, 10 + index), _tokens(2, 20 + index)) == len(history)
    run.scheduler.check_integrity()


def test_branch_point_survives_pressure() -> None:
    """SGLang #36935: long chains, a fork of one mid-way, then every chain again (and another fork)
    under a tight snapshot budget. The branch point keeps its snapshot; LRU-tail eviction loses it."""
    chains = [_tokens(600, 100 + i) for i in range(4)]

    def replay(policy: str) -> tuple[int, int]:
        run = _run(policy, snapshot_slots=8)
        for index, chain in enumerate(chains):
            run.serve(f"chain{index}", chain, _tokens(4, 200 + index))
        run.serve("fork1", chains[0][:320] + _tokens(200, 300), _tokens(4, 301))   # branch at 320
        for index, chain in enumerate(chains):
            run.serve(f"again{index}", chain + _tokens(40, 400 + index), _tokens(4, 500 + index))
        hit = run.serve("fork2", chains[0][:320] + _tokens(150, 600), _tokens(4, 601))
        run.scheduler.check_integrity()
        return hit, run.snapshots.stats().evicted_total

    hit, evicted = replay("hybridserve")
    assert hit == 320 and evicted > 0
    assert replay("marconi")[0] == 320
    assert replay("interval")[0] < 320                                   # its LRU let the mark at 256 go too


def test_snapshot_whose_kv_was_reclaimed_goes_first() -> None:
    run = _run("hybridserve", snapshot_slots=8, kv_blocks=30)
    first, second = _tokens(300, 30), _tokens(300, 31)
    run.serve("a", first, _tokens(3, 32))
    published = run.snapshots.num_published
    assert published >= 2
    run.serve("b", second, _tokens(3, 33))                               # reclaims a's KV blocks
    assert run.blocks.num_evictions > 0
    stats = run.snapshots.stats()
    assert stats.evicted_total >= 1 and stats.skipped_total == 0
    assert run.serve("a2", first, _tokens(3, 34)) == 0                   # a's prefix is gone: a clean miss
    for slot in run.snapshots.evictable():
        assert run.blocks.lookup(run.snapshots.key_of(slot)) is not None  # every survivor is joint
    run.scheduler.check_integrity()


def test_kv_beyond_the_deepest_snapshot_is_reclaimed_first() -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(6)
    pool.free(list(reversed(blocks[:3])))
    pool.free(list(reversed(blocks[3:])), evict_first=True)
    assert pool.allocate(3) == [blocks[5], blocks[4], blocks[3]]        # the cold tail goes first
    pool.check_integrity()


# --------------------------------------------------------------------- live engine


def _conversation_turns(llm: LLM, seeds: list[int], params: SamplingParams) -> list[tuple[int, int]]:
    """Grow one conversation from token-id prompts; returns (expected, reported) cached tokens."""
    history: list[int] = []
    pairs = []
    for turn, seed in enumerate(seeds):
        prompt = history + _tokens(30 + 7 * turn, seed)
        out = llm.generate([prompt], params)[0]
        if history:
            pairs.append((len(history) - 1, out.num_cached_tokens))
        history = prompt + out.outputs[0].token_ids
    return pairs


@pytest.mark.parametrize("policy", ["hybridserve", "marconi"])
def test_multi_turn_hits_the_end_of_the_previous_turn(text_checkpoint: Path, policy: str) -> None:
    on = LLM(model=str(text_checkpoint), kv_cache_mib=16, cache_policy=policy)
    off = LLM(model=str(text_checkpoint), kv_cache_mib=16, prefix_cache_mib=0)
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    pairs = _conversation_turns(on, [1, 2, 3, 4], params)
    assert pairs and all(reported == expected for expected, reported in pairs), pairs
    history: list[int] = []
    for turn, seed in enumerate([1, 2, 3, 4]):                          # same conversation, cache off
        prompt = history + _tokens(30 + 7 * turn, seed)
        warm = on.generate([prompt], params)[0]
        cold = off.generate([prompt], params)[0]
        assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
        history = prompt + cold.outputs[0].token_ids
    on.llm_engine.check_integrity()


def _chat_rounds(seed: int) -> list[list[list[int]]]:
    """Rounds of branching multi-turn prompts: shared system prompts, forks, and conversations
    whose next turn is the previous prompt plus a new message (outputs appended by the caller)."""
    rng = random.Random(seed)
    systems = [_tokens(rng.randint(40, 200), seed=1000 + i) for i in range(3)]
    conversations = [list(rng.choice(systems)) + _tokens(rng.randint(1, 40), seed * 7 + i) for i in range(6)]
    conversations.append(list(conversations[0][: len(conversations[0]) // 2]))  # a fork mid-way
    return [[c] for c in conversations]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_differential_cache_on_equals_off_for_every_policy(text_checkpoint: Path, policy: str) -> None:
    probe = LLM(model=str(text_checkpoint), kv_cache_mib=16, prefix_cache_mib=0)
    snapshot_mib = 10.5 * probe.llm_engine.bytes_per_snapshot / (1 << 20)
    on = LLM(model=str(text_checkpoint), cache_policy=policy, snapshot_interval=32, prefix_cache_mib=snapshot_mib,
             kv_cache_mib=220 * 4 / 1024, max_num_batched_tokens=160, max_num_seqs=4)
    off = LLM(model=str(text_checkpoint), prefix_cache_mib=0, kv_cache_mib=16, max_num_batched_tokens=1024)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    rng = random.Random(len(policy))
    conversations = [c[0] for c in _chat_rounds(len(policy))]
    for turn in range(3):
        batch = [c for c in conversations if rng.random() < 0.85]
        out_on = on.generate(batch, params)
        out_off = off.generate(batch, params)
        assert [o.outputs[0].token_ids for o in out_on] == [o.outputs[0].token_ids for o in out_off]
        for conversation, out in zip(batch, out_off):
            conversation.extend(out.outputs[0].token_ids + _tokens(rng.randint(3, 30), turn * 100 + len(conversation)))
        on.llm_engine.check_integrity()
    stats = on.prefix_cache_stats()
    assert stats.hits > 0
    pool = on.llm_engine.cache.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert on.llm_engine.cache.state_slots.num_free_slots == on.llm_engine.cache.state_slots.num_slots

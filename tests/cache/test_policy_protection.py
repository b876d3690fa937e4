"""hybridserve keeps branch points (shared prefixes such as documents) out of ordinary eviction while
they have been idle no longer than branch points' reuses have shown, up to the share of the pool
their restored tokens earn; a prompt mark or resume then takes only free or covered slots."""

from __future__ import annotations

import pytest

from hybridserve.cache.policy import (
    AGE_TURNOVERS,
    EVICTION_WINDOW,
    GHOSTS_PER_SLOT,
    REUSE_GAPS_KEPT,
    BranchProtection,
    HybridServePolicy,
    RequestView,
)
from hybridserve.sim.shapes import model_shape
from hybridserve.sim.simulator import AccountingRun, SimConfig
from tests.helpers.policy_pools import policy_and_pool, publish

VIEW = RequestView(num_prompt_tokens=700, num_tokens=700, branch_point=320, deepest_snapshot=0)


def test_the_horizon_is_the_longest_idle_gap_before_a_reuse() -> None:
    protection = BranchProtection()
    assert protection.horizon() == AGE_TURNOVERS and protection.share() == 0.0
    protection.restored(True, 3.0, 100)
    protection.restored(True, 40.0, 100)
    protection.restored(False, None, 100)
    assert protection.horizon() == 40.0
    assert protection.share() == pytest.approx(2 / 3, rel=0.01)
    protection.restored(False, None, 1000)                             # a share of the restored tokens
    assert protection.share() == pytest.approx(200 / 1300, rel=0.01)
    protection.evicted(b"doc", last_use=100, num_slots=10, restores=0)
    protection.published(b"doc", clock=1100, num_slots=10)            # back 100 turnovers after its last use
    assert protection.horizon() == 100.0
    protection.published(b"doc", clock=5000, num_slots=10)            # a ghost counts once
    assert protection.horizon() == 100.0
    for _ in range(REUSE_GAPS_KEPT):                                   # old gaps age out
        protection.restored(True, 1.0, 100)
    assert protection.horizon() == 1.0


def test_a_document_outlives_deeper_unproven_ends_while_branch_points_earn_restores() -> None:
    policy, pool, kinds = policy_and_pool(4)
    document = publish(policy, pool, kinds, b"doc", 64, "branch")
    ends = [publish(policy, pool, kinds, f"end{index}".encode(), 4096, "end") for index in range(3)]
    assert pool.choose_victim is not None
    assert pool.choose_victim(pool) == document                        # no restores yet: value decides
    policy.observe_restore("branch", 0, b"doc")                        # branch points earn the pool
    assert pool.choose_victim(pool) in ends
    for _ in range(int(AGE_TURNOVERS * 4) + 1):                        # idle past the horizon
        pool.touch(b"end0")
    assert pool.choose_victim(pool) == document


def test_protected_snapshots_fill_at_most_their_share_of_the_pool() -> None:
    """Branch points earn the share of the restored tokens they served: one 64-token document
    restore against one 4,096-token end restore earns none of the four slots."""
    policy, pool, kinds = policy_and_pool(4)
    documents = [publish(policy, pool, kinds, f"doc{index}".encode(), 64, "branch") for index in range(3)]
    publish(policy, pool, kinds, b"end", 4096, "end")
    policy.observe_restore("branch", 0, b"doc0")
    assert pool.choose_victim is not None and pool.choose_victim(pool) not in documents
    policy.observe_restore("end", 0, b"end")
    assert policy.protection.share() == pytest.approx(64 / (64 + 4096), rel=0.01)
    assert pool.choose_victim(pool) in documents


def test_a_prompt_mark_or_resume_never_pushes_out_the_last_unprotected_slot_holder() -> None:
    policy, pool, kinds = policy_and_pool(2)
    publish(policy, pool, kinds, b"doc0", 64, "branch")
    publish(policy, pool, kinds, b"doc1", 128, "branch")
    assert not policy.is_opportunistic(VIEW, 688)                      # no branch restores: nothing protected
    policy.observe_restore("branch", 0, b"doc0")
    policy.observe_restore("branch", 1, b"doc0")                       # branch points as good as ends
    resume = VIEW._replace(resumes=True)
    assert policy.is_opportunistic(VIEW, 688)                          # the prompt mark
    assert policy.is_opportunistic(resume, 320)
    assert not policy.is_opportunistic(VIEW, 320)                      # another branch point may evict
    assert policy.is_opportunistic(VIEW, 688, demoted=True)            # with a lower tier too
    assert not policy.is_opportunistic(VIEW, 256, demoted=True)        # interval marks evict into a tier


def test_an_evicted_document_captured_again_lengthens_the_horizon() -> None:
    policy, pool, kinds = policy_and_pool(2)
    publish(policy, pool, kinds, b"doc", 64, "branch")
    publish(policy, pool, kinds, b"end0", 4096, "end")
    assert pool.choose_victim is not None
    victim = pool.choose_victim(pool)
    assert pool.key_of(victim) == b"doc"                               # no branch restores yet
    reservation = pool.reserve(b"end1", 4096)                          # the pool evicts doc itself
    del kinds[b"doc"]
    pool.publish(reservation)
    for _ in range(200):
        pool.touch(b"end1")
    end = pool.lookup(b"end0")
    assert end is not None
    pool.evict(b"end0")
    publish(policy, pool, kinds, b"doc", 64, "branch")                # wanted again ~100 turnovers later
    assert policy.protection.horizon() == pytest.approx(101.0, rel=0.02)


def test_conversations_sharing_documents_restore_them_through_the_manager() -> None:
    """Long first prompts (each with its end and prompt mark) between returns of a few shared
    documents, through the real cache manager: every return restores its document, branch points
    earn their share, and the pools' accounting holds."""
    shape = model_shape("builtin")
    run = AccountingRun(SimConfig("hybridserve", 1 << 34, 6 * shape.cost.snapshot_bytes, 16, 256), shape)
    documents = [[1000 * doc + offset for offset in range(48 + 16 * doc)] for doc in range(3)]
    hits = []
    for turn in range(40):
        prompt = documents[turn % 3] + [50_000 + 1000 * turn + offset for offset in range(300)]
        hits.append(run.serve(str(turn), prompt, [7, 8, 9]))
    assert all(hit >= len(documents[turn % 3]) for turn, hit in enumerate(hits) if turn >= 6)
    assert len(list(run.snapshots.candidates(EVICTION_WINDOW))) <= 6
    policy = run.cache.policy
    assert isinstance(policy, HybridServePolicy) and policy.protection.share() > 0.5
    run.scheduler.check_integrity()


def test_an_evicted_branch_point_captured_again_carries_its_uses() -> None:
    protection = BranchProtection()
    assert protection.uses(b"doc") == 0 and protection.uses_carried(b"doc") == 0.0
    protection.evicted(b"doc", last_use=10, num_slots=4, restores=2)
    assert protection.uses(b"doc") == 2
    protection.published(b"doc", clock=20, num_slots=4)               # captured again: one more use
    assert protection.uses(b"doc") == 3
    protection.evicted(b"doc", last_use=30, num_slots=4, restores=1)
    protection.published(b"doc", clock=40, num_slots=4)
    assert protection.uses(b"doc") == 5
    protection.published(b"new", clock=41, num_slots=4)               # never evicted: nothing carried
    assert protection.uses(b"new") == 0
    for index in range(GHOSTS_PER_SLOT * 4):                           # bounded, oldest forgotten first
        protection.evicted(f"other{index}".encode(), last_use=50, num_slots=4, restores=0)
    assert protection.uses(b"doc") == 0


def test_carried_uses_are_worth_what_branch_points_that_came_back_were_restored() -> None:
    """Each carried use is worth the restores per stay of branch points captured again (one
    pseudo-stay with one restore, at most 1): where those that come back are not restored again,
    coming back proves little."""
    policy, _, _ = policy_and_pool(4)
    protection = policy.protection
    protection.evicted(b"doc", last_use=0, num_slots=4, restores=0)
    protection.published(b"doc", clock=1, num_slots=4)                # one return, no restore yet
    assert protection.uses_carried(b"doc") == pytest.approx(0.5)
    policy.observe_restore("branch", 0, b"doc")                        # the policy counts the restore
    assert protection.uses_carried(b"doc") == pytest.approx(1.0)
    protection.restored_after_return(b"doc")                           # capped at one restore per stay
    assert protection.uses_carried(b"doc") == pytest.approx(1.0)
    protection.restored_after_return(b"fresh")                         # never evicted: not counted
    for index in range(8):                                             # eight more return, none restored
        protection.evicted(f"other{index}".encode(), last_use=2, num_slots=4, restores=0)
        protection.published(f"other{index}".encode(), clock=3, num_slots=4)
    assert protection.uses_carried(b"doc") == pytest.approx(3.0 / 10.0, rel=0.01)


@pytest.mark.parametrize("served", [True, False])
def test_a_shared_prompt_that_keeps_coming_back_outweighs_a_deeper_branch_point_never_wanted_since(
        served: bool) -> None:
    """A tenant's system prompt evicted and captured again twice outlives, with no restore in its
    current stay, a document's branch point twice as deep that no request has restored, where the
    branch points that came back were restored in their new stays (`served`); where they were not,
    coming back proves little and the deeper one stays."""
    policy, pool, kinds = policy_and_pool(2)
    publish(policy, pool, kinds, b"doc", 128, "branch")
    publish(policy, pool, kinds, b"system", 64, "branch")

    def victim_key() -> bytes:                                         # the policy notes the eviction
        assert pool.choose_victim is not None
        victim = pool.choose_victim(pool)
        assert victim is not None
        return pool.key_of(victim)

    assert victim_key() == b"system"
    pool.evict(b"system")
    publish(policy, pool, kinds, b"system", 64, "branch")             # wanted again
    if served:  # restored in its new stay (as `observe_restore` counts it; the full call would also
        policy.protection.restored_after_return(b"system")  # protect the fresh one by its idle gap)
    pool.evict(b"system")                                              # gone again, as eviction would
    policy.protection.evicted(b"system", last_use=pool.clock, num_slots=2, restores=int(served))
    publish(policy, pool, kinds, b"system", 64, "branch")             # and wanted again
    assert policy.protection.uses(b"system") == 2 + int(served)
    assert victim_key() == (b"doc" if served else b"system")

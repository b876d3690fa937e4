"""The shared ("remote") tier's logical books alone (tensor-free, no server): two replicas' books over
one fake store. Published entries are written through; the books never delete from the shared
store; discovery adopts what another replica wrote; an outage or a failed write makes the books
forget (never delete) what they can no longer vouch for."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from hybridserve.cache.block_pool import block_hashes_for
from hybridserve.cache.tiers import DiscoveryQuery, JointEntry, TieredCache, TierSpec
from tests.cache.test_tiers import BLOCK, SIZES, FakeDevice, FakeMover, _entry, _seed_device


class SharedMover(FakeMover):
    """A `FakeMover` whose "remote" store is shared with other replicas', and that records discards."""

    def __init__(self, device: FakeDevice, shared: dict[str, tuple[int, ...]]) -> None:
        super().__init__(device)
        self.stores["remote"] = shared
        self.discarded: list[tuple[str, str]] = []

    def discard(self, tier: str, keys: Sequence[str]) -> None:
        self.discarded += [(tier, key) for key in keys]
        super().discard(tier, keys)


class FakeDiscovery:
    """Finds the deepest block-end entry whose objects are all in the shared store."""

    def __init__(self, shared: dict[str, tuple[int, ...]]) -> None:
        self.shared = shared
        self.came_back = False
        self.answers: list[tuple[int, JointEntry | None, bool]] = []

    def start_lookup(self, lookup: int, query: DiscoveryQuery) -> bool:
        found = None
        for blocks in range(min(len(query.block_hashes), query.limit // query.block_size), 0, -1):
            prefix = query.block_hashes[:blocks]
            if blocks * query.block_size > query.deeper_than and f"state-{prefix[-1].hex()}" in self.shared \
                    and all(f"kv-{block.hex()}" in self.shared for block in prefix):
                found = JointEntry(prefix[-1], blocks * query.block_size, tuple(prefix), 0)
                break
        self.answers.append((lookup, found, True))
        return True

    def poll_lookups(self) -> list[tuple[int, JointEntry | None, bool]]:
        answers, self.answers = self.answers, []
        return answers

    def store_came_back(self) -> bool:
        came_back, self.came_back = self.came_back, False
        return came_back


def _replica(shared: dict[str, tuple[int, ...]], budget: int = 10**6) -> tuple[TieredCache, SharedMover,
                                                                               FakeDiscovery, FakeDevice]:
    device = FakeDevice()
    mover, discovery = SharedMover(device, shared), FakeDiscovery(shared)
    tiers = TieredCache([TierSpec("host", 10**6), TierSpec("remote", budget, shared=True)], SIZES, mover,
                        discovery=discovery)
    return tiers, mover, discovery, device


def _query(tokens: list[int], deeper_than: int = 0) -> DiscoveryQuery:
    return DiscoveryQuery(tuple(block_hashes_for(tokens, BLOCK)), len(tokens) - 1, deeper_than, BLOCK,
                          lambda blocks, length: b"")


def test_only_the_last_tier_may_be_shared() -> None:
    with pytest.raises(ValueError, match="only the last tier"):
        TieredCache([TierSpec("remote", 1, shared=True), TierSpec("disk", 1)], SIZES, FakeMover(FakeDevice()))


def test_a_published_entry_is_written_through_and_another_replica_discovers_it() -> None:
    shared: dict[str, tuple[int, ...]] = {}
    one, _, _, device = _replica(shared)
    tokens = list(range(64))
    entry = _entry(tokens[:48])
    one.publish(entry, 0, _seed_device(device, entry, tokens[:48], 0).get)  # write-back: only the remote copy
    one.poll()
    assert one.stats()[0].entries == 0 and one.stats()[1].entries == 1
    assert shared[f"state-{entry.key.hex()}"] == tuple(tokens[:48])

    two, _, _, _ = _replica(shared)
    assert two.lookup(_query(tokens).block_hashes, 63, 0, BLOCK, lambda b, t: b"") is None  # not in its books
    lookup = two.discover(_query(tokens))
    assert lookup is not None and two.discovering(lookup)
    two.poll()
    assert not two.discovering(lookup)
    hit = two.lookup(_query(tokens).block_hashes, 63, 0, BLOCK, lambda b, t: b"")
    assert hit is not None and hit.tier == "remote" and hit.entry == entry
    stats = two.stats()[1]
    assert (stats.lookups, stats.discovered, stats.entries) == (1, 1, 1)
    two.check_integrity()
    assert two.discover(_query(tokens, deeper_than=48)) is not None  # nothing deeper: found none
    two.poll()
    assert two.stats()[1].discovered == 1


def test_the_books_never_delete_from_the_shared_store() -> None:
    shared: dict[str, tuple[int, ...]] = {}
    budget = 2 * (SIZES.state_bytes + 3 * SIZES.kv_block_bytes)  # room for two entries of three blocks
    one, mover, _, device = _replica(shared, budget)
    for seed in range(4):
        tokens = [seed * 1000 + t for t in range(48)]
        entry = _entry(tokens)
        one.publish(entry, seed, _seed_device(device, entry, tokens, seed).get)
        one.poll()
    remote = one.stats()[1]
    assert remote.evictions == 2 and remote.entries == 2
    assert not [key for tier, key in mover.discarded if tier == "remote"]
    assert sum(key.startswith("state-") for key in shared) == 4  # the store keeps all (its own LRU bounds it)
    assert one.forget(_entry([1000 * 3 + t for t in range(48)]).key) == 1
    assert sum(key.startswith("state-") for key in shared) == 4
    one.check_integrity()


def test_an_outage_or_a_failed_write_makes_the_books_forget_without_deleting() -> None:
    shared: dict[str, tuple[int, ...]] = {}
    one, mover, discovery, device = _replica(shared)
    tokens = list(range(64))
    short, long = _entry(tokens[:32]), _entry(tokens[:48])
    blocks = _seed_device(device, long, tokens[:48], 0) | _seed_device(device, short, tokens[:32], 1)
    one.publish(short, 1, blocks.get)
    one.poll()
    discovery.came_back = True  # the server restarted: it may hold nothing now
    one.poll()
    assert one.stats()[1].entries == 0 and shared  # forgotten, not deleted

    one.publish(short, 1, blocks.get)
    one.poll()
    mover.fail_rate = 1.0  # the long entry's write fails: its prefix's objects may be gone too
    one.publish(long, 0, blocks.get)
    one.poll()
    remote = one.stats()[1]
    assert remote.failed == 1 and remote.entries == 0  # the short entry shares its blocks: forgotten
    assert not [key for tier, key in mover.discarded if tier == "remote"]
    one.check_integrity()

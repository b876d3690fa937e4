"""The shared ("remote") tier's logical books alone (tensor-free, no server): two replicas' books over
one fake store. Published entries are written through; the books never delete from the shared
store; discovery adopts what another replica wrote; an outage or a failed write makes the books
forget (never delete) what they can no longer vouch for."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from hybridserve.cache.block_pool import block_hashes_for
from hybridserve.cache.tiers import DiscoveryQuery, JointEntry, TieredCache, TierSpec
from hybridserve.config import POLICY_NAMES
from tests.cache.test_tiers import BLOCK, SIZES, FakeDevice, FakeMover, _entry, _replay, _seed_device, _workload


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
        """Every boundary on the path, deepest first (tails before the block end below them)."""
        size, found = query.block_size, None
        for blocks in range(min(len(query.block_hashes), query.limit // size), -1, -1):
            prefix = query.block_hashes[:blocks]
            candidates = [JointEntry(key, blocks * size + t, (*prefix, key), t)
                          for t in range(size - 1, 0, -1) for key in [query.tail_key(blocks, t)]]
            if blocks:
                candidates.append(JointEntry(prefix[-1], blocks * size, tuple(prefix), 0))
            for entry in candidates:
                if query.deeper_than < entry.num_tokens <= query.limit and self._whole(entry):
                    found = found or entry
        self.answers.append((lookup, found, True))
        return True

    def _whole(self, entry: JointEntry) -> bool:
        return f"state-{entry.key.hex()}" in self.shared and all(f"kv-{b.hex()}" in self.shared for b in entry.blocks)

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


def test_the_remote_tier_scrapes_as_tier_families_with_lookups() -> None:
    """`/metrics`: the remote tier's counters, discovery lookups included, in the
    `hybridserve_tier_<field>{tier="remote"}` families (as `engine.stats()` flattens them)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from hybridserve.server.metrics import EngineStatsCollector

    shared: dict[str, tuple[int, ...]] = {}
    tiers, _, _, _ = _replica(shared)
    tiers.discover(_query(list(range(64))))
    tiers.poll()
    collector = EngineStatsCollector()
    collector.stats = {f"tier_{s.name}_{k}": v for s in tiers.stats() for k, v in s._asdict().items() if k != "name"}
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert 'hybridserve_tier_lookups_total{tier="remote"} 1.0' in text
    assert 'hybridserve_tier_discovered_total{tier="remote"} 0.0' in text
    assert 'hybridserve_tier_promoted_bytes_total{tier="remote"} 0.0' in text


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_second_replica_restores_what_the_first_published(policy: str) -> None:
    """Replica one serves a workload of chats and branches; replica two, with a cold device, serves
    it again: its hits come from the shared store by discovery, the fake engine checks every
    restored state and block against the request's tokens, and integrity holds after every step."""
    workload = _workload(5, 30)
    shared: dict[str, tuple[int, ...]] = {}
    one, _, _, device_one = _replica(shared)
    first = _replay(policy, 1, one, workload, 2, device_one)
    two, mover, _, device_two = _replica(shared)
    second = _replay(policy, 1, two, workload, 2, device_two)
    remote = two.stats()[1]
    assert remote.discovered > 0 and remote.hits > 0 and remote.failed == 0
    assert sum(second.values()) >= sum(first.values())  # it starts with everything one published
    assert not [key for tier, key in mover.discarded if tier == "remote"]
    two.check_integrity()

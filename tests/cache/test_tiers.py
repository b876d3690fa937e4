"""Lower cache tiers: the logical books alone, and the manager with tiers behind a tiny device pool,
driven through the real scheduler with a fake device and a fake in-memory mover whose "bytes" are the
token prefixes each object stands for, so every restore is checked against the request's tokens."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from hybridserve.cache.block_pool import BlockPool, block_hashes_for
from hybridserve.cache.manager import JointCacheManager
from hybridserve.cache.policy import PrefixCost, make_policy
from hybridserve.cache.snapshots import SnapshotPool
from hybridserve.cache.state_slots import StateSlotPool
from hybridserve.cache.tiers import DEVICE, STATE, JointEntry, ObjectSizes, TieredCache, TierObject, TierSpec
from hybridserve.config import POLICY_NAMES, SchedulerConfig
from hybridserve.engine.request import Request
from hybridserve.engine.scheduler import Scheduler
from hybridserve.sampling_params import SamplingParams

BLOCK = 16
COST = PrefixCost(1.0e6, 1.0, 64, 1000)
SIZES = ObjectSizes(state_bytes=1000, kv_block_bytes=BLOCK * 64)
Content = tuple[int, ...]


class FakeDevice:
    """The device's contents: each snapshot slot, live slot and KV block holds the tokens it stands for."""

    def __init__(self) -> None:
        self.snapshots: dict[int, Content] = {}
        self.live: dict[int, Content] = {}
        self.blocks: dict[int, Content] = {}


class FakeMover:
    """An in-memory `TierMover` for tests: reads its sources when a transfer starts (as the engine
    must), except device sources the device keeps (`device_kept`): those are read when the transfer
    completes or when `reusing` names them, whichever comes first (so a slot or block the manager
    hands out without `reusing` would be copied with its new contents); writes the destination
    when it completes, after `delay` polls; `fail` fails a transfer."""

    def __init__(self, device: FakeDevice, delay: int = 0, fail_rate: float = 0.0, seed: int = 0) -> None:
        self.device = device
        self.delay = delay
        self.fail_rate = fail_rate
        self.random = random.Random(seed)
        self.stores: dict[str, dict[str, Content]] = {}
        self._in_flight: list[list[object]] = []  # [polls left, ticket, tier or DEVICE, [(obj, content)]]
        self.failed: set[tuple[str, str]] = set()  # objects of failed writes (the store may hold parts)

    def _read(self, obj: TierObject) -> Content:
        if obj.source == DEVICE:
            assert obj.device_index is not None
            table = self.device.snapshots if obj.kind == STATE else self.device.blocks
            return table[obj.device_index]
        return self.stores[obj.source][obj.key]

    def start_demotion(self, ticket: int, tier: str, objects: Sequence[TierObject], device_kept: bool = False) -> None:
        """Read every source now (device sources the device keeps: later); write into `tier` on completion."""
        late = [device_kept and obj.source == DEVICE for obj in objects]
        self._in_flight.append([self.delay, ticket, tier,
                                [(obj, None if later else self._read(obj)) for obj, later in zip(objects, late)]])

    def reusing(self, kind: str, indices: Sequence[int]) -> None:
        """Read the device sources not read yet among these slots or blocks."""
        for transfer in self._in_flight:
            transfer[3] = [(obj, self._read(obj) if content is None and obj.kind == kind
                            and obj.device_index in indices else content)
                           for obj, content in transfer[3]]  # type: ignore[attr-defined]

    def start_promotion(self, ticket: int, objects: Sequence[TierObject]) -> None:
        """Read every source tier now; write the device slot and blocks on completion."""
        self._in_flight.append([self.delay, ticket, DEVICE, [(obj, self._read(obj)) for obj in objects]])

    def discard(self, tier: str, keys: Sequence[str]) -> None:
        """Forget objects (each must have been written, or be in flight to this tier)."""
        store = self.stores.setdefault(tier, {})
        for key in keys:
            if store.pop(key, None) is None:
                in_flight = any(t[2] == tier and any(o.key == key for o, _ in t[3])  # type: ignore[attr-defined]
                                for t in self._in_flight)
                assert in_flight or (tier, key) in self.failed, f"discard of {key}, never written to {tier}"

    def poll(self) -> list[tuple[int, bool]]:
        """Complete the transfers whose delay ran out."""
        done, waiting = [], []
        for transfer in self._in_flight:
            left, ticket, tier, payload = transfer
            if left:
                transfer[0] = int(left) - 1  # type: ignore[call-overload]
                waiting.append(transfer)
                continue
            ok = self.random.random() >= self.fail_rate
            if not ok and tier != DEVICE:
                self.failed.update((str(tier), obj.key) for obj, _ in payload)  # type: ignore[attr-defined]
            if ok:
                for obj, content in payload:  # type: ignore[attr-defined]
                    content = self._read(obj) if content is None else content  # a kept device source
                    if tier == DEVICE:
                        table = self.device.snapshots if obj.kind == STATE else self.device.blocks
                        table[obj.device_index] = content
                    else:
                        self.stores.setdefault(str(tier), {})[obj.key] = content
            done.append((int(ticket), ok))  # type: ignore[call-overload]
        self._in_flight = waiting
        return done


class FakeEngine:
    """Runs the scheduler's steps on a `FakeDevice`: restores are checked against the tokens, chunks
    extend live states and write KV, captures copy the live state at their boundary."""

    def __init__(self, scheduler: Scheduler, device: FakeDevice) -> None:
        self.scheduler = scheduler
        self.device = device
        self.hits: dict[str, int] = {}

    def step(self) -> None:
        """One scheduled step, then a sampled token (or a finish) for each request that completed."""
        cache, device = self.scheduler.cache, self.device
        cache.poll_tiers()
        output = self.scheduler.schedule()
        for restore in output.restores:
            tokens = tuple(restore.request.token_ids[:restore.num_tokens])
            if restore.kv_copy is not None:
                device.blocks[restore.kv_copy[1]] = device.blocks[restore.kv_copy[0]]
            state = device.snapshots[restore.snapshot_slot] if restore.snapshot_slot is not None else ()
            assert state == tokens, "restored a state of another prefix"
            device.live[restore.state_slot] = state
            table = cache.block_table(restore.request)
            for index in range(-(-restore.num_tokens // BLOCK)):
                want = tokens[index * BLOCK:(index + 1) * BLOCK]
                assert device.blocks[table[index]][:len(want)] == want, "restored KV of another prefix"
        for chunk in output.chunks:
            tokens = chunk.request.token_ids
            assert device.live[chunk.state_slot] == tuple(tokens[:chunk.start]), "live state out of step"
            for position in range(chunk.start, chunk.start + chunk.length):
                block, offset = chunk.block_ids[position // BLOCK], position % BLOCK
                previous = device.blocks.get(block, ()) if offset else ()
                device.blocks[block] = previous[:offset] + (tokens[position],)
            for reservation in chunk.captures:
                assert reservation.slot is not None
                device.snapshots[reservation.slot] = tuple(tokens[:reservation.num_tokens])
            device.live[chunk.state_slot] = tuple(tokens[:chunk.start + chunk.length])
        for request in self.scheduler.apply(output, set()):
            if request.num_cached_tokens is not None:
                self.hits.setdefault(request.request_id, request.num_cached_tokens)
            if len(request.output_token_ids) < request.params.max_tokens:
                request.append_token(1000 + len(request.token_ids) % 7)
            if len(request.output_token_ids) >= request.params.max_tokens:
                slot = cache.state_slot(request)
                capture = self.scheduler.finish(request, "length")
                if capture is not None:
                    device.snapshots[capture.reservation.slot] = device.live[slot]  # type: ignore[index]
                    self.scheduler.complete_end_capture(capture, True)
        self.scheduler.check_integrity()


def _entry(tokens: Sequence[int]) -> JointEntry:
    hashes = block_hashes_for(tokens, BLOCK)
    assert len(tokens) % BLOCK == 0
    return JointEntry(hashes[-1], len(tokens), tuple(hashes), 0)


def _tiers(host: int, disk: int, mover: FakeMover, write_through: bool = False) -> TieredCache:
    return TieredCache([TierSpec("host", host), TierSpec("disk", disk)], SIZES, mover, write_through)


def _seed_device(device: FakeDevice, entry: JointEntry, tokens: Sequence[int], slot: int) -> dict[bytes, int]:
    """Put an entry's state and KV on the fake device; its blocks by hash."""
    device.snapshots[slot] = tuple(tokens)
    blocks = {}
    for index, block in enumerate(entry.blocks):
        device.blocks[100 + slot * 10 + index] = tuple(tokens[index * BLOCK:(index + 1) * BLOCK])
        blocks[block] = 100 + slot * 10 + index
    return blocks


def test_shared_kv_is_stored_once_and_freed_with_its_last_entry() -> None:
    """Two entries on one path share their first block: the tier holds it once, budgets count it once,
    and it leaves the tier (and the store) with the last entry that needs it."""
    device, tokens = FakeDevice(), list(range(48))
    mover = FakeMover(device)
    tiers = _tiers(10**6, 10**6, mover)
    short, long = _entry(tokens[:16]), _entry(tokens[:48])
    blocks = _seed_device(device, long, tokens, 0) | _seed_device(device, short, tokens[:16], 1)
    assert tiers.demote(short, 1, blocks.get) and tiers.demote(long, 0, blocks.get)
    tiers.poll()
    host = tiers.stats()[0]
    assert (host.entries, host.kv_objects, host.used_bytes) == (2, 3, 2 * SIZES.state_bytes + 3 * SIZES.kv_block_bytes)
    assert host.demoted_objects == 2 + 3  # the shared block was copied once
    tiers.check_integrity()
    assert tiers.forget(long.key) == 1
    assert tiers.stats()[0].kv_objects == 1 and len(mover.stores["host"]) == 2
    tiers.check_integrity()


def test_lookup_waits_for_the_write_and_finds_the_deepest_entry() -> None:
    device, tokens = FakeDevice(), list(range(64))
    mover = FakeMover(device, delay=1)
    tiers = _tiers(10**6, 10**6, mover)
    entry = _entry(tokens[:48])
    blocks = _seed_device(device, entry, tokens[:48], 0)
    tiers.demote(entry, 0, blocks.get)
    hashes = block_hashes_for(tokens, BLOCK)
    assert tiers.lookup(hashes, 63, 0, BLOCK, lambda b, t: b"") is None  # still being written
    tiers.poll()
    tiers.poll()
    hit = tiers.lookup(hashes, 63, 0, BLOCK, lambda b, t: b"")
    assert hit is not None and hit.tier == "host" and hit.entry == entry
    assert tiers.lookup(hashes, 63, 48, BLOCK, lambda b, t: b"") is None  # not deeper than the device's
    tiers.check_integrity()


def test_eviction_cascades_host_to_disk_then_drops() -> None:
    """Host fits one entry, disk two: a third demotion pushes the oldest down to disk, a fourth drops
    the oldest from disk; nothing is ever over budget and the stores hold exactly the books."""
    device = FakeDevice()
    mover = FakeMover(device)
    one = SIZES.state_bytes + SIZES.kv_block_bytes
    tiers = _tiers(one, 2 * one, mover)
    entries = []
    for index in range(4):
        tokens = list(range(1000 * index, 1000 * index + 16))
        entry = _entry(tokens)
        tiers.demote(entry, index, _seed_device(device, entry, tokens, index).get)
        tiers.poll()
        tiers.check_integrity()
        entries.append(entry)
    host, disk = tiers.stats()
    assert [e.key for e in tiers.tiers[0].entries.values()] == [entries[3].key]
    assert [e.key for e in tiers.tiers[1].entries.values()] == [entries[1].key, entries[2].key]
    assert host.evictions == 3 and disk.evictions == 1 and disk.demotions == 3
    assert len(mover.stores["host"]) == 2 and len(mover.stores["disk"]) == 4


def test_an_entry_without_its_kv_is_never_demoted() -> None:
    device, tokens = FakeDevice(), list(range(32))
    tiers = _tiers(10**6, 10**6, FakeMover(device))
    entry = _entry(tokens)
    blocks = _seed_device(device, entry, tokens, 0)
    del blocks[entry.blocks[0]]  # the first block left the device and no tier has it
    assert not tiers.demote(entry, 0, blocks.get)
    assert tiers.stats()[0].dropped == 1 and tiers.stats()[0].entries == 0
    tiers.check_integrity()


def test_a_failed_write_or_read_is_a_miss() -> None:
    device, tokens = FakeDevice(), list(range(32))
    mover = FakeMover(device, fail_rate=1.0)
    tiers = _tiers(10**6, 10**6, mover)
    entry = _entry(tokens)
    tiers.demote(entry, 0, _seed_device(device, entry, tokens, 0).get)
    tiers.poll()
    assert tiers.find(entry.key) is None and tiers.stats()[0].failed == 1
    tiers.check_integrity()
    mover.fail_rate = 0.0
    tiers.demote(entry, 0, _seed_device(device, entry, tokens, 0).get)
    tiers.poll()
    hit = tiers.find(entry.key)
    assert hit is not None
    ticket = tiers.promote(hit, 5, [(entry.blocks[1], 77)])
    assert tiers.forget(entry.key) == 0  # pinned while read
    tiers.check_integrity()
    mover.fail_rate = 1.0
    assert tiers.poll() == [(ticket, False)]
    tiers.complete_promotion(ticket, False)
    assert tiers.find(entry.key) is None  # a corrupt object drops its entry
    tiers.check_integrity()


def _request(name: str, tokens: list[int], outputs: int) -> Request:
    return Request(name, None, tokens, SamplingParams(max_tokens=outputs, ignore_eos=True))


def _workload(seed: int, count: int) -> list[tuple[str, list[int], int]]:
    """Multi-turn chats (each turn extends the last prompt and its outputs) and branches off shared
    system prompts, in a random order."""
    rng = random.Random(seed)
    systems = [[rng.randrange(50, 900) for _ in range(rng.choice((16, 24, 40)))] for _ in range(3)]
    chats: list[list[int]] = []  # each chat's tokens so far (prompt and outputs of its last turn)
    requests = []
    for index in range(count):
        if chats and rng.random() < 0.5:
            chat = rng.randrange(len(chats))
            prompt = chats[chat] + [rng.randrange(50, 900) for _ in range(rng.randrange(1, 30))]
        else:
            chat = len(chats)
            prompt = list(rng.choice(systems)) + [rng.randrange(50, 900) for _ in range(rng.randrange(1, 40))]
            chats.append([])
        outputs = rng.randrange(1, 6)
        requests.append((f"r{index}", prompt, outputs))
        chats[chat] = prompt + [1000 + (len(prompt) + k) % 7 for k in range(outputs)]  # what FakeEngine samples
    return requests


def _replay(policy: str, snapshot_slots: int, tiers: TieredCache | None, workload: list[tuple[str, list[int], int]],
            concurrent: int, device: FakeDevice, blocks: int = 512) -> dict[str, int]:
    """Serve `workload` with at most `concurrent` requests in flight; cached tokens per request."""
    pool = SnapshotPool(snapshot_slots)
    manager = JointCacheManager(BLOCK, BlockPool(blocks), StateSlotPool(4), pool,
                                make_policy(policy, BLOCK, COST, 32), tiers=tiers)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_prefill_tokens_during_decode=0), manager)
    engine = FakeEngine(scheduler, device)
    pending = list(workload)
    while pending or scheduler.has_unfinished():
        while pending and len(scheduler.waiting) + len(scheduler.running) < concurrent:
            name, prompt, outputs = pending.pop(0)
            scheduler.add(_request(name, prompt, outputs))
        engine.step()
    for _ in range(4):  # let ownerless promotions and writes settle
        engine.step()
    return engine.hits


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("seed", [0, 1])
def test_tiers_keep_what_a_large_device_pool_keeps(policy: str, seed: int) -> None:
    """One request at a time, one device snapshot slot, and host + disk large enough: every hit is
    exact (the fake engine checks each restored state and block), integrity holds after every step,
    and the hits are at least those of one device slot without tiers."""
    workload = _workload(seed, 40)
    device = FakeDevice()
    mover = FakeMover(device)
    tiers = _tiers(SIZES.state_bytes + 4 * SIZES.kv_block_bytes, 10**7, mover)
    tiered = _replay(policy, 1, tiers, workload, 1, device)
    alone = _replay(policy, 1, None, workload, 1, FakeDevice())
    large = _replay(policy, 256, None, workload, 1, FakeDevice())
    promotions = sum(s.promotions for s in tiers.stats())
    assert promotions > 0 and tiers.stats()[1].demotions > 0  # both tiers were used
    assert sum(tiered.values()) >= sum(alone.values())
    if policy == "interval":
        # Its admission does not depend on the device's occupancy once one chunk's captures fit the
        # slots (a chunk's own reservations cannot evict each other): then tiers keep every hit.
        slots = max(len(prompt) for _, prompt, _ in workload) // 32 + 2
        device = FakeDevice()
        few = _tiers(6 * (SIZES.state_bytes + 4 * SIZES.kv_block_bytes), 10**7, FakeMover(device))
        assert _replay(policy, slots, few, workload, 1, device) == large
        assert sum(_replay(policy, slots, None, workload, 1, FakeDevice()).values()) < sum(large.values())


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("write_through", [False, True])
def test_concurrent_promotions_with_delays_and_faults(policy: str, write_through: bool) -> None:
    """Four requests in flight, transfers that take a few steps and sometimes fail, tight tiers:
    requests wait for their own promotion, no restore is ever wrong, integrity holds every step."""
    workload = _workload(7, 60)
    device = FakeDevice()
    mover = FakeMover(device, delay=2, fail_rate=0.1, seed=3)
    entry = SIZES.state_bytes + 3 * SIZES.kv_block_bytes
    tiers = _tiers(3 * entry, 8 * entry, mover, write_through)
    hits = _replay(policy, 2, tiers, workload, 4, device, blocks=96)
    assert len(hits) == len(workload)
    stats = tiers.stats()
    assert sum(s.promotions for s in stats) > 0 and sum(s.failed for s in stats) > 0
    assert not tiers.pending_promotions()

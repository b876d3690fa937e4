"""Which entry a lower tier evicts (`EntryValues`: GreedyDual-Frequency with restore rates learned
per label), what it refuses, and hybridserve's captures per chunk bounded by the slots the pool can
give."""

from __future__ import annotations

from collections.abc import Callable

from hybridserve.cache.block_pool import BlockPool, block_hashes_for, hash_tail
from hybridserve.cache.policy import PrefixCost, RequestView, make_policy
from hybridserve.cache.snapshots import SnapshotPool
from hybridserve.cache.tiers import BLOCK_END, END, EntryValues, JointEntry, ObjectSizes, TieredCache, TierSpec
from tests.cache.test_tiers import FakeDevice, FakeMover, _seed_device

BLOCK = 16
SIZES = ObjectSizes(state_bytes=1000, kv_block_bytes=BLOCK * 64)


def _block_entry(tokens: list[int]) -> JointEntry:
    hashes = block_hashes_for(tokens, BLOCK)
    return JointEntry(hashes[-1], len(tokens), tuple(hashes), 0)


def _end_entry(tokens: list[int]) -> JointEntry:
    full = len(tokens) // BLOCK
    hashes = block_hashes_for(tokens, BLOCK)
    key = hash_tail(hashes[-1] if hashes else None, tokens[full * BLOCK:])
    return JointEntry(key, len(tokens), (*hashes, key), len(tokens) - full * BLOCK)


def _lowest(values: EntryValues) -> bytes | None:
    found = values.lowest(lambda key: False)
    return found[0] if found is not None else None


def test_one_class_without_restores_is_lru_and_a_restore_buys_time_where_restores_repeat() -> None:
    values = EntryValues()
    entries = [_block_entry(list(range(100 * i, 100 * i + 32))) for i in range(3)]
    for entry in entries:
        values.add(entry)
    assert values.prior(BLOCK_END) == 0.0 and _lowest(values) == entries[0].key
    hot = [_block_entry(list(range(10_000 + 100 * i, 10_000 + 100 * i + 32))) for i in range(20)]
    for entry in hot:  # restored again and again: here a restore predicts more
        values.add(entry)
        for _ in range(3):
            values.restored(entry.key)
    for entry in hot:
        values.remove(entry.key)
    values.restored(entries[0].key)
    assert _lowest(values) == entries[1].key
    values.remove(entries[1].key)
    values.check_integrity({entries[0].key, entries[2].key})
    assert _lowest(values) == entries[2].key


def test_a_restore_costs_time_where_restored_entries_do_not_come_back() -> None:
    """Conversation turn ends: each is restored once by the next turn, which then carries on from
    its own end; the learned rate of a once-restored end falls below a fresh one's."""
    values = EntryValues()
    turns = [_end_entry(list(range(100 * i, 100 * i + 40))) for i in range(60)]
    for index, entry in enumerate(turns):
        values.add(entry, kind=END)
        if index:
            values.restored(turns[index - 1].key)
    assert 0.0 < values.prior(END + "+1", 40) < values.prior(END, 40) / 4
    assert _lowest(values) in {entry.key for entry in turns[:-1]}  # a restored end goes first


def test_the_prior_follows_the_restore_rate_of_each_class() -> None:
    """Rates are restores per unit of residence: request ends restored as they come, a stream of
    marks never restored."""
    values = EntryValues()
    for turn in range(20):
        end = _end_entry(list(range(100 * turn, 100 * turn + 40)))
        values.add(end)
        for index in range(10):
            values.add(_block_entry(list(range(5000 + 1000 * turn + 10 * index, 5000 + 1000 * turn + 10 * index + 32))))
        values.restored(end.key)
    assert values.prior(END) > 10 * values.prior(BLOCK_END) > 0.0


def test_ends_that_come_back_outlive_a_flood_of_marks_that_do_not() -> None:
    """A host tier of eight entries: three request ends that keep being restored, and a flood of
    twice as many interval-mark-like entries as fit; under LRU the flood would push every end out,
    by value the ends stay. They still age out (GDSF's floor) once they stop coming back and newer
    ends that are as likely to come back keep arriving."""
    device = FakeDevice()
    mover = FakeMover(device)
    one = SIZES.state_bytes + 3 * SIZES.kv_block_bytes
    tiers = TieredCache([TierSpec("host", 8 * one)], SIZES, mover)
    slot = 0

    def demote(entry: JointEntry, tokens: list[int]) -> None:
        nonlocal slot
        slot += 1
        tiers.demote(entry, slot, _seed_device(device, entry, tokens, slot).get)
        tiers.poll()

    def restore(entry: JointEntry) -> None:
        hit = tiers.find(entry.key)
        assert hit is not None
        ticket = tiers.promote(hit, 90, [])
        assert tiers.poll() == [(ticket, True)]
        tiers.complete_promotion(ticket, True)

    ends = []
    for index in range(3):
        tokens = list(range(1000 * index, 1000 * index + 40))
        ends.append(_end_entry(tokens))
        demote(ends[-1], tokens)
        restore(ends[-1])

    def flood(count: int, first: int, make: Callable[[list[int]], JointEntry] = _block_entry,
              restoring: bool = False) -> None:
        for index in range(first, first + count):
            tokens = list(range(50_000 + 1000 * index, 50_000 + 1000 * index + 40))
            demote(make(tokens), tokens)
            tiers.check_integrity()
            if restoring and index % 4 == 3:
                for end in ends:
                    restore(end)

    flood(16, 0, restoring=True)
    assert all(tiers.find(end.key) is not None for end in ends)
    assert tiers.stats()[0].evictions + tiers.stats()[0].dropped >= 8  # LRU would have pushed the ends out
    flood(200, 16, _end_entry)
    assert all(tiers.find(end.key) is None for end in ends)


def test_captures_of_one_chunk_keep_the_deepest_when_slots_are_short() -> None:
    cost = PrefixCost(1.0e6, 1.0, 64, 1000)
    policy = make_policy("hybridserve", BLOCK, cost, 2 * BLOCK)
    policy.bind(BlockPool(64), SnapshotPool(3))
    view = RequestView(num_prompt_tokens=330, num_tokens=330, branch_point=0, deepest_snapshot=0)
    prompt_mark = (329 // BLOCK) * BLOCK  # 320, an interval mark too
    assert policy.captures(view, 0, 330) == [256, 288, prompt_mark]
    roomy = make_policy("hybridserve", BLOCK, cost, 2 * BLOCK)
    roomy.bind(BlockPool(64), SnapshotPool(64))
    assert roomy.captures(view, 0, 330) == list(range(32, prompt_mark + 1, 32))
    branching = view._replace(branch_point=48)  # a branch point is kept however short the slots
    assert policy.captures(branching, 0, 330) == [48, 288, prompt_mark]


def test_rates_are_learned_per_kind_and_depth() -> None:
    """Shallow prompt marks that come back and deep interval marks that do not, of one class (block
    ends): the labels keep their rates apart, and a depth bucket without evidence leans on its kind."""
    values = EntryValues()
    for turn in range(20):
        shallow = _block_entry(list(range(100 * turn, 100 * turn + 32)))
        values.add(shallow, kind="prompt")
        for index in range(10):
            start = 9000 + 10_000 * turn + 600 * index
            values.add(_block_entry(list(range(start, start + 512))), kind="interval")
        values.restored(shallow.key)
    assert values.prior("prompt", 32) > 10 * values.prior("interval", 512) > 0.0
    assert values.prior("prompt", 4096) > 10 * values.prior("interval", 512)  # no evidence at this depth: the kind's
    assert values.kind(shallow.key) == "prompt"
    deep = _block_entry(list(range(9000, 9000 + 512)))
    assert values.current(shallow.key) > values.current(deep.key)


def test_a_full_tier_refuses_an_entry_worth_less_than_what_it_holds() -> None:
    """A one-tier cache full of ends that come back: an interval mark (a kind seen often and never
    restored) is refused, counted as dropped, instead of pushing an end out; an end like the others
    gets in, the oldest one making room."""
    device = FakeDevice()
    mover = FakeMover(device)
    one = SIZES.state_bytes + 3 * SIZES.kv_block_bytes
    tiers = TieredCache([TierSpec("host", 4 * one)], SIZES, mover)

    def demote(entry: JointEntry, tokens: list[int], slot: int, kind: str) -> bool:
        done = tiers.demote(entry, slot, _seed_device(device, entry, tokens, slot).get, kind=kind)
        tiers.poll()
        tiers.check_integrity()
        return done

    for index in range(40):  # the tier learns that interval marks do not come back
        tokens = list(range(200_000 + 1000 * index, 200_000 + 1000 * index + 40))
        assert demote(_block_entry(tokens), tokens, 100 + index, "interval")
    ends = []
    for index in range(4):
        tokens = list(range(1000 * index, 1000 * index + 40))
        ends.append(_end_entry(tokens))
        assert demote(ends[-1], tokens, index, "end")
        hit = tiers.find(ends[-1].key)
        assert hit is not None and tiers.kind_of(hit) == "end"
        ticket = tiers.promote(hit, 90, [])
        tiers.poll()
        tiers.complete_promotion(ticket, True)
    for index in range(8):  # marks of a kind never restored: each one refused
        tokens = list(range(50_000 + 1000 * index, 50_000 + 1000 * index + 40))
        assert not demote(_block_entry(tokens), tokens, 10 + index, "interval")
    assert all(tiers.find(end.key) is not None for end in ends)
    assert tiers.stats()[0].dropped == 8
    tokens = list(range(90_000, 90_040))
    assert demote(_end_entry(tokens), tokens, 30, "end")
    assert tiers.find(ends[0].key) is None and tiers.find(_end_entry(tokens).key) is not None


def test_a_failed_state_write_drops_only_its_own_entry() -> None:
    """A block-end entry's key is also its last block's hash: when writing its state fails, a deeper
    entry whose prefix holds that block (written, and restored from) stays."""
    device = FakeDevice()
    mover = FakeMover(device)
    tiers = TieredCache([TierSpec("host", 10 * SIZES.state_bytes + 10 * SIZES.kv_block_bytes)], SIZES, mover)
    tokens = list(range(40))
    deeper, mark = _end_entry(tokens), _block_entry(tokens[:32])
    assert mark.key in deeper.blocks
    assert tiers.demote(deeper, 1, _seed_device(device, deeper, tokens, 1).get, kind="end")
    tiers.poll()
    hit = tiers.find(deeper.key)
    assert hit is not None
    ticket = tiers.promote(hit, 9, [])
    assert tiers.poll() == [(ticket, True)]
    tiers.complete_promotion(ticket, True)
    mover.fail_rate = 1.0  # the mark's state write fails (its KV blocks are there already)
    assert tiers.demote(mark, 2, _seed_device(device, mark, tokens[:32], 2).get, kind="interval")
    assert tiers.poll() == []
    tiers.check_integrity()
    assert tiers.find(mark.key) is None and tiers.find(deeper.key) is not None
    assert tiers.stats()[0].failed == 1

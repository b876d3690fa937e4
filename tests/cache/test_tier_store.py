"""The physical stores of the lower cache tiers (hybridserve/cache/tier_store.py, store_mover.py):
exact round trips, faults as counted misses, budgets, crash safety, permissions, restarts, the
fingerprint and the flags. Waits are on events and pipes, never on wall-clock thresholds."""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save, save_file

from hybridserve.cache import tier_store
from hybridserve.cache.store_mover import StoreMover, TierEvent
from hybridserve.cache.tier_dir import DiskCacheDirError, check_disk_cache_dir
from hybridserve.cache.tier_store import (
    FORMAT_VERSION,
    HEADER,
    DiskStore,
    HostStore,
    Payload,
    PutResult,
    TierStores,
    TierStoreStats,
    build_tier_stores,
    engine_fingerprint,
    filename_to_key,
    key_to_filename,
    model_fingerprint,
    payload_nbytes,
)
from hybridserve.config import CacheConfig, EngineConfig
from hybridserve.engine_args import engine_config_from_args

REPO_ROOT = Path(__file__).resolve().parents[2]
FINGERPRINT = "f" * 32
EVENT_WAIT_S = 60.0  # a safety net for a broken mover; every wait returns as soon as its event arrives


def _payload(seed: int = 0) -> Payload:
    generator = torch.Generator().manual_seed(seed)
    return {
        "kv.0.k": torch.randn(2, 16, 4, 8, generator=generator).to(torch.bfloat16),
        "kv.0.v": torch.randn(2, 16, 4, 8, generator=generator),
        "gdn.1.conv": torch.randint(-128, 127, (3, 5), dtype=torch.int8, generator=generator),
        "gdn.1.recurrent": torch.randn(4, 8, 8, generator=generator),
        "scalar": torch.tensor(7, dtype=torch.int64),
    }


def _assert_same(got: Mapping[str, torch.Tensor] | None, want: Mapping[str, torch.Tensor]) -> None:
    assert got is not None
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[DiskStore]:
    store = DiskStore(tmp_path / "cache", FINGERPRINT, 1 << 20)
    yield store
    store.close()


def _object_path(store: DiskStore, key: str) -> Path:
    return store.path / key_to_filename(key)


# -- round trips --------------------------------------------------------------------------------


def test_disk_round_trip_is_exact(disk: DiskStore) -> None:
    payload = _payload()
    result = disk.put("state-ab12", payload)
    assert result.ok and result.evicted == ()
    _assert_same(disk.get("state-ab12"), payload)
    _assert_same(disk.get("state-ab12"), payload)  # reading does not consume
    stats = disk.stats()
    assert (stats.objects, stats.puts, stats.gets, stats.hits, stats.misses) == (1, 1, 2, 2, 0)
    assert stats.bytes == _object_path(disk, "state-ab12").stat().st_size == result.nbytes


def test_host_round_trip_is_exact_and_a_copy() -> None:
    host = HostStore(1 << 20)
    payload = _payload()
    assert host.put("kv-01", payload).ok
    expected = {name: t.clone() for name, t in payload.items()}
    for tensor in payload.values():
        tensor.zero_()  # the source slot is reused: the stored copy must not change
    _assert_same(host.get("kv-01"), expected)
    assert host.stats().bytes == payload_nbytes(expected)


def test_empty_payload_and_escaped_keys_round_trip(disk: DiskStore) -> None:
    key = "tenant:9f/κ state.x%"
    assert filename_to_key(key_to_filename(key)) == key
    assert "/" not in key_to_filename(key) and not key_to_filename(key).startswith(".")
    assert disk.put(key, {}).ok
    assert disk.get(key) == {}
    assert disk.keys() == [key]
    with pytest.raises(ValueError):
        key_to_filename("x" * 300)


# -- faults are counted misses --------------------------------------------------------------------


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - 5)


def _wrong_version(path: Path) -> None:
    data = bytearray(path.read_bytes())
    magic, _, key_length, payload_length, checksum = HEADER.unpack_from(data)
    HEADER.pack_into(data, 0, magic, FORMAT_VERSION + 1, key_length, payload_length, checksum)
    path.write_bytes(bytes(data))


def _truncate_into_header(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(HEADER.size - 3)


def _another_keys_object(path: Path) -> None:
    """The object of a longer key under this file's name (the reader splits header and payload by
    the key it asked for)."""
    data = bytearray(path.read_bytes())
    magic, version, key_length, payload_length, checksum = HEADER.unpack_from(data)
    key = bytes(data[HEADER.size:HEADER.size + key_length]) + b"-other"
    path.write_bytes(HEADER.pack(magic, version, len(key), payload_length, checksum) + key
                     + bytes(data[HEADER.size + key_length:]))


def _append_bytes(path: Path) -> None:
    """Bytes past the payload the header declares (the reader reads one byte past the indexed size)."""
    with open(path, "ab") as handle:
        handle.write(b"trailing garbage")


@pytest.mark.parametrize("damage", [_flip_last_byte, _truncate, _wrong_version, _truncate_into_header,
                                    _another_keys_object, _append_bytes])
def test_damaged_object_is_a_counted_miss_and_deleted(disk: DiskStore, damage: Any) -> None:
    disk.put("state-1", _payload())
    disk.put("state-2", _payload(1))
    damage(_object_path(disk, "state-1"))
    assert disk.get("state-1") is None
    stats = disk.stats()
    assert (stats.corrupt_misses, stats.misses, stats.hits, stats.objects) == (1, 1, 0, 1)
    assert not _object_path(disk, "state-1").exists() and not disk.contains("state-1")
    assert stats.bytes == _object_path(disk, "state-2").stat().st_size
    _assert_same(disk.get("state-2"), _payload(1))  # the neighbour is untouched


def test_deleted_file_is_a_counted_missing_miss(disk: DiskStore) -> None:
    disk.put("state-1", _payload())
    _object_path(disk, "state-1").unlink()
    assert disk.get("state-1") is None
    stats = disk.stats()
    assert (stats.missing_misses, stats.corrupt_misses, stats.misses, stats.objects, stats.bytes) == (1, 0, 1, 0, 0)
    assert disk.get("never-stored") is None and disk.stats().misses == 2


def test_damaged_objects_are_dropped_at_start(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, FINGERPRINT, 1 << 20)
    for index in range(3):
        store.put(f"state-{index}", _payload(index))
    store.close()
    _wrong_version(_object_path(store, "state-0"))
    _truncate(_object_path(store, "state-1"))
    restarted = DiskStore(tmp_path, FINGERPRINT, 1 << 20)
    try:
        assert restarted.keys() == ["state-2"]
        assert restarted.stats().corrupt_misses == 2
        assert sorted(p.name for p in restarted.path.glob("*.obj")) == [key_to_filename("state-2")]
    finally:
        restarted.close()


# -- budgets and failed writes --------------------------------------------------------------------


def test_full_disk_is_a_counted_failed_write(disk: DiskStore, monkeypatch: pytest.MonkeyPatch) -> None:
    disk.put("state-old", _payload())

    def no_space(fd: int, data: bytes) -> None:
        os.write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tier_store, "_write_all", no_space)
    result = disk.put("state-new", _payload(1))
    assert not result.ok
    stats = disk.stats()
    assert (stats.failed_writes, stats.puts, stats.objects) == (1, 1, 1)
    assert disk.keys() == ["state-old"] and stats.bytes == _object_path(disk, "state-old").stat().st_size
    assert [p.name for p in disk.path.iterdir() if p.name.startswith(".tmp-")] == []
    assert disk.get("state-new") is None
    # replacing an existing key fails the same way and leaves no stale file behind
    assert not disk.put("state-old", _payload(2)).ok
    assert disk.keys() == [] and not _object_path(disk, "state-old").exists()


def test_disk_budget_evicts_least_recently_used(tmp_path: Path) -> None:
    size = len(tier_store._object_bytes("state-0", tier_store.encode_payload(_payload())))
    store = DiskStore(tmp_path, FINGERPRINT, 2 * size + size // 2)
    try:
        store.put("state-0", _payload())
        store.put("state-1", _payload())
        assert store.get("state-0") is not None  # now state-1 is the least recently used
        result = store.put("state-2", _payload())
        assert result.ok and result.evicted == ("state-1",)
        assert store.keys() == ["state-0", "state-2"] and store.stats().evictions == 1
        assert store.stats().bytes <= store.budget_bytes
        assert sum(p.stat().st_size for p in store.path.glob("*.obj")) == store.stats().bytes
        too_big = {"x": torch.zeros(4 * size, dtype=torch.uint8)}
        assert not store.put("state-big", too_big).ok and store.stats().refused_puts == 1
        assert store.keys() == ["state-0", "state-2"]
    finally:
        store.close()


def test_host_budget_refuses_and_never_raises() -> None:
    payload = _payload()
    host = HostStore(payload_nbytes(payload) + 10)
    assert host.put("a", payload).ok
    refused = host.put("b", payload)
    assert not refused.ok and refused.evicted == ()
    assert host.put("a", _payload(1)).ok  # replacing a key counts only the new bytes
    stats = host.stats()
    assert (stats.refused_puts, stats.puts, stats.objects) == (1, 2, 1)
    assert host.keys() == ["a"] and host.get("b") is None
    assert host.delete("a") and host.stats().bytes == 0 and not host.delete("a")


@pytest.mark.parametrize("in_arena", [True, False], ids=["arena-slot", "own-memory"])
def test_host_put_that_fails_to_copy_releases_its_reservation(monkeypatch: pytest.MonkeyPatch, in_arena: bool) -> None:
    host = HostStore(1 << 20)

    def broken_copy(*args: Any, **kwargs: Any) -> Payload:
        raise RuntimeError("copy failed")

    if in_arena:
        monkeypatch.setattr(tier_store, "_copy_into_slots", broken_copy)
    else:  # no slot for it: the copy into memory of its own fails
        monkeypatch.setattr(tier_store.HostArena, "take", lambda self, signature: None)
        monkeypatch.setattr(tier_store, "_host_copy", broken_copy)
    with pytest.raises(RuntimeError):
        host.put_many([("a", _payload()), ("b", _payload(1))])
    assert (host.stats().bytes, host.stats().objects, host.keys()) == (0, 0, [])
    host.check_integrity()  # the slots taken for the failed copies are free again
    monkeypatch.undo()
    assert host.put("a", _payload()).ok
    _assert_same(host.get("a"), _payload())
    host.check_integrity()


# -- the asynchronous front -----------------------------------------------------------------------


class _SlowStore:
    """A store whose puts wait until `release` is set (a slow disk)."""

    def __init__(self, inner: DiskStore) -> None:
        self.inner = inner
        self.tier = inner.tier
        self.budget_bytes = inner.budget_bytes
        self.release = threading.Event()
        self.writing = threading.Event()

    def put(self, key: str, payload: Mapping[str, torch.Tensor], ready: Any = None) -> PutResult:
        self.writing.set()
        assert self.release.wait(EVENT_WAIT_S)
        return self.inner.put(key, payload, ready)

    def get(self, key: str) -> Payload | None:
        return self.inner.get(key)

    def delete(self, key: str) -> bool:
        return self.inner.delete(key)

    def contains(self, key: str) -> bool:
        return self.inner.contains(key)

    def keys(self) -> list[str]:
        return self.inner.keys()

    def stats(self) -> TierStoreStats:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()


def _collect(mover: StoreMover, count: int) -> list[TierEvent]:
    events: list[TierEvent] = []
    while len(events) < count:
        batch = mover.poll(timeout=EVENT_WAIT_S)
        assert batch, f"no event within the safety net; got {events}"
        events.extend(batch)
    return events


def test_slow_disk_never_blocks_submit_or_poll(disk: DiskStore) -> None:
    slow = _SlowStore(disk)
    mover = StoreMover(slow, max_pending=2)
    try:
        assert mover.submit_put("state-a", _payload())
        assert slow.writing.wait(EVENT_WAIT_S)  # the thread is now stuck inside the write
        assert mover.submit_put("state-b", _payload(1))
        assert mover.submit_get("state-a")
        assert not mover.submit_put("state-c", _payload(2))  # queue full: refused at once, counted
        mover.submit_delete("state-b")  # deletes are never refused
        assert mover.poll() == []
        assert mover.stats().refused == 1 and mover.stats().pending == 3
        slow.release.set()
        events = _collect(mover, 4)
        # the get of a (whose put is no longer queued) takes the read lane, ahead of the queued put of b
        assert [(e.key, e.kind, e.ok) for e in events] == [
            ("state-a", "put", True), ("state-a", "get", True), ("state-b", "put", True), ("state-b", "delete", True)]
        assert [e.seq for e in events] == [1, 3, 2, 4]
        _assert_same(events[1].payload, _payload())
        assert events[1].nbytes == payload_nbytes(_payload()) and events[0].payload is None
        assert all(e.seconds >= 0 for e in events)
    finally:
        slow.release.set()
        mover.close()


def test_reads_go_ahead_of_writes_but_never_of_their_own_key(disk: DiskStore) -> None:
    """A promotion's gets do not wait behind unrelated queued puts; a get of a key with a queued put
    or delete runs after it; a delete submitted after a get never runs before it."""
    slow = _SlowStore(disk)
    mover = StoreMover(slow, max_pending=16)
    try:
        assert mover.submit_put("state-a", _payload()) == 1
        assert slow.writing.wait(EVENT_WAIT_S)  # the thread is inside put a
        assert mover.submit_many([("state-b", _payload(1)), ("state-c", _payload(2))]) == 2
        assert mover.submit_get("state-b") == 4          # b's put is queued: behind it
        assert mover.submit_get("state-a") == 5          # nothing of a queued: read lane
        assert mover.submit_delete("state-a") == 6       # after the get of a
        assert mover.submit_get("state-a") == 7          # a's delete is queued: behind it (a miss)
        slow.release.set()
        events = _collect(mover, 7)
        assert [(e.seq, e.kind, e.ok) for e in events] == [
            (1, "put", True), (5, "get", True), (2, "put", True), (3, "put", True), (4, "get", True),
            (6, "delete", True), (7, "get", False)]
        _assert_same(events[1].payload, _payload())
        _assert_same(events[4].payload, _payload(1))
    finally:
        slow.release.set()
        mover.close()


def test_mover_refuses_a_batch_whole(disk: DiskStore) -> None:
    mover = StoreMover(disk, max_pending=2)
    try:
        assert mover.submit_many([("state-a", _payload()), ("state-b", _payload(1)), ("state-c", _payload(2))]) is None
        assert mover.stats().refused == 3 and mover.stats().submitted == 0
        assert mover.submit_many([("state-a", _payload()), ("state-b", _payload(1))]) == 1
        assert [e.key for e in _collect(mover, 2)] == ["state-a", "state-b"]
    finally:
        mover.close()


def test_mover_get_miss_cancel_and_drained_close(disk: DiskStore) -> None:
    slow = _SlowStore(disk)
    mover = StoreMover(slow)
    mover.submit_put("state-a", _payload())
    assert slow.writing.wait(EVENT_WAIT_S)
    mover.submit_put("state-b", _payload(1))
    mover.submit_get("state-b")
    mover.submit_get("state-c")
    assert mover.cancel("state-b") == 2
    slow.release.set()
    events = _collect(mover, 2)
    assert [(e.key, e.kind, e.ok, e.payload) for e in events[1:]] == [("state-c", "get", False, None)]
    mover.submit_put("state-d", _payload(3))
    mover.close()  # drains: the queued put reaches the disk
    assert disk.keys() == ["state-a", "state-d"] and mover.stats().cancelled == 2
    with pytest.raises(RuntimeError):
        mover.submit_get("state-a")


def test_a_submission_of_gets_is_read_in_one_call_in_order() -> None:
    """Gets submitted together from a store with `get_many` come back as one event each, in order,
    with a miss where a key is absent; a store that raises fails the whole batch, counted as misses
    by the mover, not as a dead thread."""
    store = HostStore(1 << 20)
    store.put("kv-a", _payload())
    store.put("kv-b", _payload(1))
    mover = StoreMover(store)
    try:
        first = mover.submit_many([("kv-a", None), ("kv-missing", None), ("kv-b", None)])
        assert first is not None
        events = _collect(mover, 3)
        assert [(e.seq - first, e.key, e.ok) for e in events] == [(0, "kv-a", True), (1, "kv-missing", False),
                                                                  (2, "kv-b", True)]
        got = events[2].payload
        assert got is not None and torch.equal(got["kv.0.v"], _payload(1)["kv.0.v"])
        assert events[0].nbytes == payload_nbytes(_payload())
        assert (store.stats().gets, store.stats().hits, store.stats().misses) == (3, 2, 1)

        def broken(keys: Sequence[str]) -> list[Any]:
            raise OSError("store went away")

        store.get_many = broken  # type: ignore[method-assign]
        mover.submit_many([("kv-a", None), ("kv-b", None)])
        assert [(e.key, e.ok) for e in _collect(mover, 2)] == [("kv-a", False), ("kv-b", False)]
        mover.submit_get("kv-a")  # the thread lives on
        assert _collect(mover, 1)[0].ok is False
    finally:
        mover.close()


def test_held_writes_wait_while_reads_run_until_released(disk: DiskStore) -> None:
    mover = StoreMover(disk, max_pending=8)
    try:
        mover.submit_put("state-a", _payload())
        _collect(mover, 1)
        mover.hold_writes(True)
        assert mover.submit_put("state-b", _payload(1)) == 2
        assert mover.submit_get("state-a") == 3
        assert [(e.seq, e.kind, e.ok) for e in _collect(mover, 1)] == [(3, "get", True)]
        assert not disk.contains("state-b") and mover.stats().pending == 1
        mover.hold_writes(False)
        assert [(e.seq, e.kind, e.ok) for e in _collect(mover, 1)] == [(2, "put", True)]
        assert disk.contains("state-b")
    finally:
        mover.close()


def test_a_held_write_waits_through_one_forward_at_most(disk: DiskStore) -> None:
    """Back-to-back forwards leave the thread no gap to write in: a write queued before the
    previous hold runs during the next one, so a demoted entry does not stay unreadable."""
    mover = StoreMover(disk, max_pending=64)
    try:
        mover.hold_writes(True)  # a forward
        assert mover.submit_put("state-a", _payload()) == 1
        assert mover.poll(timeout=0.05) == [] and not disk.contains("state-a")  # held through it
        mover.hold_writes(False)  # too short a gap to matter here: the next forward holds at once
        mover.hold_writes(True)
        assert [(e.seq, e.kind, e.ok) for e in _collect(mover, 1)] == [(1, "put", True)]
        assert mover.submit_put("state-b", _payload(1)) == 2  # queued during this forward: waits
        assert mover.poll(timeout=0.05) == [] and not disk.contains("state-b")
    finally:
        mover.hold_writes(False)
        mover.close()


def test_held_writes_run_anyway_once_the_queue_is_half_full(disk: DiskStore) -> None:
    """Holding only defers writes: under sustained load they must not pile up to refusals."""
    mover = StoreMover(disk, max_pending=4)
    try:
        mover.hold_writes(True)
        assert mover.submit_put("state-a", _payload()) == 1  # a quarter full: held
        assert mover.submit_put("state-b", _payload(1)) == 2  # half full: writes run, still held,
        assert [(e.seq, e.ok) for e in _collect(mover, 1)] == [(1, True)]  # until it is below half
        assert mover.stats().pending == 1
        mover.submit_put("state-c", _payload(2))
        mover.close()  # closing drains held writes too
        assert disk.keys() == ["state-a", "state-b", "state-c"]
    finally:
        mover.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_encoded_payload_is_the_safetensors_format(dtype: torch.dtype) -> None:
    payload = {"keys": torch.arange(24).reshape(2, 3, 4).to(dtype),
               "values": torch.arange(60).reshape(3, 4, 5).to(dtype).transpose(0, 2)}  # not contiguous
    encoded = tier_store.encode_payload(payload)
    assert encoded == save({name: t.contiguous() for name, t in payload.items()})
    _assert_same(tier_store.decode_payload(encoded), payload)


# -- crash safety ---------------------------------------------------------------------------------

CHILD_WRITER = """
import os, sys, time
import torch
from hybridserve.cache import tier_store
store = tier_store.DiskStore(sys.argv[1], sys.argv[2], 1 << 20)
def half_then_hang(fd, data):
    os.write(fd, data[: len(data) // 2])
    print("writing", flush=True)
    while True:
        time.sleep(60)
tier_store._write_all = half_then_hang
store.put("state-1", {"x": torch.arange(4096, dtype=torch.float32)})
"""


def test_sigkill_during_a_write_leaves_the_old_object_and_a_temp_file_the_next_start_removes(
        tmp_path: Path) -> None:
    store = DiskStore(tmp_path, FINGERPRINT, 1 << 20)
    store.put("state-1", _payload())
    store.close()
    child = subprocess.Popen([sys.executable, "-c", CHILD_WRITER, str(tmp_path), FINGERPRINT], cwd=REPO_ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()  # blocks until the child is inside the write
        assert line.strip() == "writing", child.stderr.read() if child.stderr else ""
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    temps = [p for p in (tmp_path / FINGERPRINT).iterdir() if p.name.startswith(".tmp-")]
    assert len(temps) == 1
    restarted = DiskStore(tmp_path, FINGERPRINT, 1 << 20)
    try:
        assert restarted.removed_temp_files == 1
        assert not [p for p in restarted.path.iterdir() if p.name.startswith(".tmp-")]
        assert restarted.keys() == ["state-1"]
        _assert_same(restarted.get("state-1"), _payload())  # the old object, whole
    finally:
        restarted.close()


# -- permissions and directories ------------------------------------------------------------------


def test_files_are_0600_in_a_0700_directory(tmp_path: Path) -> None:
    old_umask = os.umask(0)
    try:
        store = DiskStore(tmp_path / "new" / "cache", FINGERPRINT, 1 << 20)
        store.put("state-1", _payload())
    finally:
        os.umask(old_umask)
    try:
        assert stat.S_IMODE(store.path.stat().st_mode) == 0o700
        assert stat.S_IMODE((tmp_path / "new" / "cache").stat().st_mode) == 0o700
        assert stat.S_IMODE(_object_path(store, "state-1").stat().st_mode) == 0o600
    finally:
        store.close()


def _make_unusable(path: Path) -> None:
    """A directory this process may not use: not ours (as root) or not writable (otherwise)."""
    path.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
    else:
        path.chmod(0o500)


@pytest.mark.parametrize("setup", ["unusable", "group-writable", "a-file", "under-a-file"])
def test_an_unusable_directory_is_one_clear_error(tmp_path: Path, setup: str) -> None:
    target = tmp_path / "cache"
    if setup == "unusable":
        _make_unusable(target)
    elif setup == "group-writable":
        target.mkdir()
        target.chmod(0o770)
    elif setup == "a-file":
        target.write_text("")
    else:
        (tmp_path / "file").write_text("")
        target = tmp_path / "file" / "cache"
    with pytest.raises(DiskCacheDirError) as raised:
        DiskStore(target, FINGERPRINT, 1 << 20)
    message = str(raised.value)
    assert "\n" not in message and str(target) in message
    with pytest.raises(ValueError):
        CacheConfig(disk_cache_dir=str(target), disk_cache_size_bytes=1 << 20)


def test_a_directory_in_use_is_refused(disk: DiskStore) -> None:
    with pytest.raises(DiskCacheDirError, match="in use"):
        DiskStore(disk.path.parent, FINGERPRINT, 1 << 20)


# -- restarts and fingerprints --------------------------------------------------------------------


def test_restart_lists_surviving_keys_in_recency_order(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, FINGERPRINT, 1 << 20)
    for index in range(3):
        store.put(f"state-{index}", _payload(index))
    for index, path in enumerate(_object_path(store, f"state-{i}") for i in range(3)):
        os.utime(path, (1000 + index, 1000 + index))  # distinct times, whatever the clock's grain
    store.get("state-0")  # touched: now the most recently used
    store.close()
    restarted = DiskStore(tmp_path, FINGERPRINT, 1 << 20)
    try:
        assert restarted.keys() == ["state-1", "state-2", "state-0"]
        assert restarted.stats().objects == 3
        for index in range(3):
            _assert_same(restarted.get(f"state-{index}"), _payload(index))
    finally:
        restarted.close()
    other = DiskStore(tmp_path, "0" * 32, 1 << 20)
    try:
        assert other.keys() == [] and other.get("state-0") is None
    finally:
        other.close()
    for index, key in enumerate(["state-2", "state-0", "state-1"]):
        os.utime(_object_path(store, key), (2000 + index, 2000 + index))
    smaller = DiskStore(tmp_path, FINGERPRINT, 2 * _object_path(store, "state-0").stat().st_size)
    try:  # a smaller budget at start evicts the least recently used
        assert smaller.keys() == ["state-0", "state-1"] and smaller.stats().evictions == 1
        assert not _object_path(store, "state-2").exists()
    finally:
        smaller.close()


def _fingerprint(**changes: Any) -> str:
    arguments: dict[str, Any] = {"model_config": {"hidden_size": 64}, "dtype": "float32", "block_size": 16,
                                 "block_hash": "xxh3_128", "weights": {"w": torch.ones(3)}, "tokenizer_json": "{}"}
    arguments.update(changes)
    return model_fingerprint(**arguments)


def test_fingerprint_changes_with_every_input(tmp_path: Path) -> None:
    base = _fingerprint()
    assert base == _fingerprint() and len(base) == 32
    variants = [_fingerprint(dtype="bfloat16"), _fingerprint(block_size=32), _fingerprint(block_hash="sha256"),
                _fingerprint(model_config={"hidden_size": 65}), _fingerprint(tokenizer_json='{"a": 1}'),
                _fingerprint(weights={"w": torch.tensor([1.0, 1.0, 1.5])}),
                _fingerprint(weights={"w": torch.ones(3, dtype=torch.bfloat16)}),
                _fingerprint(extra={"quantization": "int8"})]
    assert len({base, *variants}) == len(variants) + 1
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"w": torch.ones(3)}, str(first))
    save_file({"w": torch.ones(4)}, str(second))
    by_files = {_fingerprint(weights=None, weight_files=[path]) for path in (first, second)}
    assert len(by_files) == 2 and base not in by_files


def test_engine_fingerprint_reads_a_model_directory_or_the_built_in_weights(tmp_path: Path) -> None:
    save_file({"w": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    from_dir = EngineConfig(model=str(tmp_path))
    arguments: dict[str, Any] = {"model_config": {"hidden_size": 64}, "dtype": torch.float32, "tokenizer_json": "{}"}
    by_dir = engine_fingerprint(from_dir, **arguments)
    assert by_dir == engine_fingerprint(from_dir, weights={"ignored": torch.zeros(1)}, **arguments)
    assert by_dir != engine_fingerprint(EngineConfig(model=str(tmp_path), quantization="int8"), **arguments)
    assert by_dir != engine_fingerprint(from_dir, **{**arguments, "dtype": torch.bfloat16})
    builtin = engine_fingerprint(EngineConfig(), weights={"w": torch.ones(3)}, **arguments)
    other_builtin = engine_fingerprint(EngineConfig(), weights={"w": torch.zeros(3)}, **arguments)
    assert len({by_dir, builtin, other_builtin}) == 3
    with pytest.raises(ValueError):
        engine_fingerprint(EngineConfig(), **arguments)


# -- configuration and flags ----------------------------------------------------------------------


def _parse(*flags: str) -> Any:
    from hybridserve.server.cli import build_parser

    return build_parser().parse_args(list(flags))


def test_flags_build_the_cache_config(tmp_path: Path) -> None:
    config = engine_config_from_args(_parse("--host-cache-memory", "1.5GiB", "--disk-cache-dir", str(tmp_path),
                                            "--disk-cache-size", "8G", "--tier-write-policy", "write-back"))
    cache = config.cache
    assert (cache.host_cache_memory_bytes, cache.disk_cache_size_bytes) == (3 << 29, 8 * 1000 ** 3)
    assert (cache.disk_cache_dir, cache.tier_write_policy) == (str(tmp_path), "write-back")
    off = engine_config_from_args(_parse()).cache
    assert (off.host_cache_memory_bytes, off.disk_cache_dir, off.disk_cache_size_bytes) == (0, None, None)
    assert off.tier_write_policy == "write-through"  # the default, as the API's
    assert CacheConfig().tier_write_policy == "write-through"


@pytest.mark.parametrize(("flags", "needle"), [
    (("--host-cache-memory", "lots"), "--host-cache-memory: invalid size 'lots'"),
    (("--disk-cache-dir", "{tmp}", "--disk-cache-size", "12 parsecs"), "--disk-cache-size: invalid size"),
    (("--disk-cache-dir", "{tmp}"), "needs --disk-cache-size"),
    (("--disk-cache-size", "1G"), "needs --disk-cache-dir"),
])
def test_bad_tier_flags_are_one_line_value_errors(tmp_path: Path, flags: tuple[str, ...], needle: str) -> None:
    with pytest.raises(ValueError) as raised:
        engine_config_from_args(_parse(*(flag.replace("{tmp}", str(tmp_path)) for flag in flags)))
    assert needle in str(raised.value) and "\n" not in str(raised.value)


def test_cli_reports_a_bad_directory_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from hybridserve import cli

    monkeypatch.setattr(cli, "prepare_command_process", dict)  # keep this process's environment as it is
    target = tmp_path / "cache"
    target.mkdir()
    target.chmod(0o777)
    assert cli.main(["generate", "--disk-cache-dir", str(target), "--disk-cache-size", "1GiB"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"hybridserve: error: --disk-cache-dir {str(target)!r} is writable by its group or others (mode 777); "
        "use chmod 700"]


def test_build_tier_stores_follows_the_config(tmp_path: Path) -> None:
    assert build_tier_stores(CacheConfig(), fingerprint=FINGERPRINT) == tier_store.TierStores()
    config = CacheConfig(host_cache_memory_bytes=1 << 20, disk_cache_dir=str(tmp_path / "d"),
                         disk_cache_size_bytes=1 << 20, tier_write_policy="write-back")
    stores = build_tier_stores(config, fingerprint=FINGERPRINT)
    try:
        assert stores.host is not None and stores.host.budget_bytes == 1 << 20
        assert stores.disk is not None and stores.disk.path == tmp_path / "d" / FINGERPRINT
        assert stores.write_policy == "write-back"
    finally:
        stores.close()
    assert check_disk_cache_dir(tmp_path / "d") == tmp_path / "d"


def _device_pools() -> tuple[Any, Any, Any]:
    """Small CPU device pools with random contents: (KV cache, snapshot tensors, `DeviceCachePools`)."""
    from types import SimpleNamespace

    from hybridserve.engine.tier_mover import DeviceCachePools
    from hybridserve.layers.attention import PagedKVCache

    kv = PagedKVCache(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=3, dtype=torch.float32,
                      device=torch.device("cpu"))
    kv.keys.copy_(torch.randn(kv.keys.shape))
    kv.values.copy_(torch.randn(kv.values.shape))
    snapshots = SimpleNamespace(conv=torch.randn(2, 5, 3, 4), recurrent=torch.randn(2, 5, 2, 3, 3), num_slots=5)
    pools = DeviceCachePools(kv, snapshots)  # type: ignore[arg-type]
    return kv, snapshots, pools


def test_device_pools_gather_scatter_and_layout_check() -> None:
    """The engine's device pools read several blocks / slots in one gather and write them back in
    one scatter, exactly; a payload of another name set, shape or dtype does not match."""
    kv, snapshots, pools = _device_pools()
    blocks = pools.read_many("kv", [4, 1]).payloads
    assert torch.equal(blocks[0]["keys"], kv.keys[:, 16:20]) and torch.equal(blocks[1]["values"], kv.values[:, 4:8])
    pools.write_many("kv", [0, 5], blocks)
    assert torch.equal(kv.keys[:, 0:4], kv.keys[:, 16:20]) and torch.equal(kv.values[:, 20:24], kv.values[:, 4:8])
    states = pools.read_many("state", [3]).payloads
    pools.write_many("state", [0], states)
    assert torch.equal(snapshots.conv[:, 0], snapshots.conv[:, 3])
    assert torch.equal(snapshots.recurrent[:, 0], snapshots.recurrent[:, 3])
    assert pools.matches("kv", blocks[0]) and pools.matches("state", states[0])
    assert not pools.matches("state", blocks[0])
    assert not pools.matches("kv", {**blocks[0], "keys": blocks[0]["keys"][:, :2]})
    assert not pools.matches("kv", {**blocks[0], "keys": blocks[0]["keys"].double()})
    assert not pools.matches("kv", {"keys": blocks[0]["keys"]})
    assert pools.read_many("kv", []) == ([], [])
    before = kv.keys[:, 8:12].clone()
    copy = pools.read_many("kv", [2]).payloads[0]
    kv.keys[:, 8:12] += 1  # the next forward reuses the block: what was read before it is a copy
    assert torch.equal(copy["keys"], before)


def test_device_reads_reuse_staging_only_once_given_back() -> None:
    """Demotions gather into staging buffers: a read while an earlier one is still held gets other
    buffers (its payloads stay intact); once given back, the next read of that size reuses them;
    nothing is kept past the limit."""
    from hybridserve.engine.tier_mover import StagingBuffers

    kv, _, pools = _device_pools()
    first = pools.read_many("kv", [0, 1, 2])
    held = first.payloads[1]["keys"].clone()
    second = pools.read_many("kv", [3, 4, 5])
    assert {b.data_ptr() for b in first.buffers}.isdisjoint(b.data_ptr() for b in second.buffers)
    assert torch.equal(first.payloads[1]["keys"], held)
    pools.release(first.buffers)
    third = pools.read_many("kv", [5, 4, 3])
    assert {b.data_ptr() for b in third.buffers} == {b.data_ptr() for b in first.buffers}
    assert torch.equal(third.payloads[2]["keys"], kv.keys[:, 12:16])
    assert torch.equal(second.payloads[0]["keys"], kv.keys[:, 12:16])
    staging = StagingBuffers(limit=200)
    buffer = staging.take(20, torch.float32)
    assert buffer.numel() == 32  # a power of two
    staging.give_back([buffer, staging.take(20, torch.float32)])
    assert staging.kept == 128  # the second (128 bytes more) was past the limit: freed
    assert staging.take(17, torch.float32) is buffer and staging.kept == 0


def test_uploads_stack_host_objects_into_one_staging_buffer() -> None:
    """A promotion to another device stacks its host objects into one staging buffer (pinned on
    CUDA) and copies that up once; the buffer is handed back to the caller for reuse. Objects
    already on the target device are stacked there, with no buffer."""
    from hybridserve.engine.tier_mover import StagingBuffers, upload_stacked

    staging = StagingBuffers(limit=1 << 20)
    sources = [torch.randn(2, 3, 4) for _ in range(5)]
    staged, buffer = upload_stacked(sources, torch.device("meta"), staging)
    assert staged.device.type == "meta" and staged.shape == (5, 2, 3, 4)
    assert buffer is not None and torch.equal(buffer[:120].view(5, 2, 3, 4), torch.stack(sources))
    staging.give_back([buffer])
    again, reused = upload_stacked(sources[:4], torch.device("meta"), staging)
    assert reused is buffer and again.shape == (4, 2, 3, 4)  # 96 elements fit the same 128
    local, none = upload_stacked(sources, torch.device("cpu"), staging)
    assert none is None and torch.equal(local, torch.stack(sources))


def test_a_kept_device_object_is_copied_before_the_slot_or_block_is_reused() -> None:
    """A write-through demotion into the host tier hands the store views of the CPU pools (no staged
    copy). `reusing` a slot or block that a queued put still reads gives that put a staged copy
    instead (here while writes are held for a forward); a put already running is waited for (no copy
    is made for it). Either way the host keeps what the device held when the snapshot was published.
    A write-back demotion (the device does not keep its copy) is staged at once: nothing to do."""
    from hybridserve.cache.tiers import DEVICE, KV, STATE, TierObject
    from hybridserve.engine.tier_mover import EngineTierMover

    kv, snapshots, pools = _device_pools()
    host = HostStore(1 << 20)
    mover = EngineTierMover(pools, TierStores(host=host))
    entered, release = threading.Event(), threading.Event()
    put_many = host.put_many

    def slow_put_many(items: Sequence[tuple[str, Mapping[str, torch.Tensor]]], ready: Any = None) -> list[PutResult]:
        if any(key == "state-d4" for key, _ in items):
            entered.set()
            release.wait(5)
        return put_many(items, ready)

    host.put_many = slow_put_many  # type: ignore[method-assign]
    try:
        state_before, keys_before = snapshots.recurrent[:, 3].clone(), kv.keys[:, 8:12].clone()
        mover.hold_writes(True)  # as during a forward: the puts wait
        mover.start_demotion(1, "host", [TierObject(STATE, "state-a1", 0, DEVICE, 3),
                                         TierObject(KV, "kv-b2", 0, DEVICE, 2)], device_kept=True)
        mover.start_demotion(2, "host", [TierObject(STATE, "state-c3", 0, DEVICE, 1)])
        mover.reusing(STATE, [0, 4])
        mover.reusing(KV, [1, 3])
        assert (mover.restaged, mover.reuse_waits) == (0, 0)  # nothing reads those
        mover.reusing(STATE, [3])
        assert (mover.restaged, mover.reuse_waits) == (1, 0)
        snapshots.recurrent[:, 3] += 1  # the next forward writes the slot
        mover.reusing(KV, [2])
        assert (mover.restaged, mover.reuse_waits) == (2, 0)
        kv.keys[:, 8:12] += 1
        slot0 = snapshots.conv[:, 0].clone()  # two queued puts read one slot: both get copies
        for ticket, key in ((4, "state-e5"), (5, "state-f6")):
            mover.start_demotion(ticket, "host", [TierObject(STATE, key, 0, DEVICE, 0)], device_kept=True)
        mover.reusing(STATE, [0])
        assert (mover.restaged, mover.reuse_waits) == (4, 0)
        snapshots.conv[:, 0] += 1
        mover.hold_writes(False)
        conv_before = snapshots.conv[:, 4].clone()
        mover.start_demotion(3, "host", [TierObject(STATE, "state-d4", 0, DEVICE, 4)], device_kept=True)
        assert entered.wait(5)  # the put of slot 4 is running
        threading.Timer(0.2, release.set).start()
        copies: list[Sequence[int]] = []
        read_many = pools.read_many
        pools.read_many = lambda kind, indices: copies.append(indices) or read_many(kind, indices)  # type: ignore[method-assign]
        mover.reusing(STATE, [4])  # too late to restage: waits for the put, and copies nothing
        assert (mover.restaged, mover.reuse_waits) == (4, 1) and not copies
        snapshots.conv[:, 4] += 1
        done: list[tuple[int, bool]] = []
        while len(done) < 5:
            mover.wait(1.0)
            done += mover.poll()
        assert sorted(done) == [(1, True), (2, True), (3, True), (4, True), (5, True)]
        assert all(torch.equal(host.get(key)["conv"], slot0) for key in ("state-e5", "state-f6"))  # type: ignore[index]
        assert torch.equal(host.get("state-a1")["recurrent"], state_before)  # type: ignore[index]
        assert torch.equal(host.get("kv-b2")["keys"], keys_before)  # type: ignore[index]
        assert torch.equal(host.get("state-c3")["conv"], snapshots.conv[:, 1])  # type: ignore[index]
        assert torch.equal(host.get("state-d4")["conv"], conv_before)  # type: ignore[index]
    finally:
        release.set()
        mover.close()


# -- reads in place ---------------------------------------------------------------------------------


def _pool_layout(objects: int = 5) -> tuple[dict[str, torch.Tensor], tier_store.PoolLayout]:
    """CPU pool tensors of several dtypes with the objects along dimension 1, and their layout."""
    pools = {"keys": torch.zeros(3, objects, 4, 2, dtype=torch.bfloat16), "values": torch.zeros(3, objects, 4, 2),
             "conv": torch.zeros(2, objects, 5, dtype=torch.int64)}
    return pools, tier_store.PoolLayout(pools)


def _object(layout: tier_store.PoolLayout, seed: int) -> Payload:
    generator = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(t.shape[:1] + t.shape[2:], generator=generator) * 100).to(t.dtype)
            for name, t in layout.tensors.items()}


def test_disk_reads_an_object_in_place_exactly(disk: DiskStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """`get_into` lands an object in its pool position (every tensor, every layer), touches no other
    position, and counts a hit; with fewer buffers per `preadv` than pieces it still reads them all."""
    pools, layout = _pool_layout()
    disk.put("kv-a", _object(layout, 1))
    disk.put("kv-b", _object(layout, 2))
    monkeypatch.setattr(tier_store, "_IOV_MAX", 3)  # the 3 x 3 layer pieces take several calls
    assert disk.get_many_into(["kv-a", "kv-b"], [tier_store.ReadTarget(layout, 3), tier_store.ReadTarget(layout, 0)])
    _assert_same(layout.tensors_of(3), _object(layout, 1))
    _assert_same(layout.tensors_of(0), _object(layout, 2))
    for position in (1, 2, 4):
        assert all(not tensor.select(1, position).any() for tensor in pools.values())
    stats = disk.stats()
    assert (stats.gets, stats.hits, stats.misses) == (2, 2, 0)
    assert not disk.get_into("kv-missing", tier_store.ReadTarget(layout, 1)) and disk.stats().misses == 1


@pytest.mark.parametrize("damage", [_flip_last_byte, _truncate, _wrong_version, _truncate_into_header,
                                    _another_keys_object, _append_bytes])
def test_a_damaged_object_read_in_place_is_a_counted_miss_and_deleted(disk: DiskStore, damage: Any) -> None:
    _, layout = _pool_layout()
    disk.put("kv-a", _object(layout, 1))
    disk.put("kv-b", _object(layout, 2))
    damage(_object_path(disk, "kv-a"))
    assert not disk.get_into("kv-a", tier_store.ReadTarget(layout, 0))
    stats = disk.stats()
    assert (stats.corrupt_misses, stats.misses, stats.hits, stats.objects) == (1, 1, 0, 1)
    assert not _object_path(disk, "kv-a").exists() and not disk.contains("kv-a")
    assert disk.get_into("kv-b", tier_store.ReadTarget(layout, 1))  # the neighbour is untouched
    _assert_same(layout.tensors_of(1), _object(layout, 2))


def test_an_object_of_another_layout_read_in_place_is_a_miss_that_stays(disk: DiskStore) -> None:
    """An intact object whose tensors differ from the target's is a plain miss (not corruption: the
    file stays); one of the same tensors under a differently written header (another safetensors
    writer's metadata) is decoded and lands all the same."""
    _, layout = _pool_layout()
    wrong = _object(layout, 1)
    disk.put("kv-wrong", {**wrong, "keys": wrong["keys"][:, :2]})
    assert not disk.get_into("kv-wrong", tier_store.ReadTarget(layout, 0))
    stats = disk.stats()
    assert (stats.misses, stats.corrupt_misses, stats.hits) == (1, 0, 0) and disk.contains("kv-wrong")
    data = save(_object(layout, 2), metadata={"writer": "another"})
    disk.put("kv-other", _object(layout, 3))
    _object_path(disk, "kv-other").write_bytes(tier_store._object_bytes("kv-other", data))
    disk._index["kv-other"] = _object_path(disk, "kv-other").stat().st_size  # as a restart would index it
    assert disk.get_into("kv-other", tier_store.ReadTarget(layout, 4))
    _assert_same(layout.tensors_of(4), _object(layout, 2))


class _PlainStore:
    """A store with only the protocol's verbs (no `get_many`, no reads in place)."""

    def __init__(self, store: HostStore) -> None:
        self.store, self.tier, self.budget_bytes = store, "plain", store.budget_bytes

    def put(self, key: str, payload: Mapping[str, torch.Tensor], ready: Any = None) -> PutResult:
        return self.store.put(key, payload, ready)

    def get(self, key: str) -> Payload | None:
        return self.store.get(key)

    def stats(self) -> TierStoreStats:
        return self.store.stats()


def test_mover_reads_in_place_from_every_store(disk: DiskStore) -> None:
    """`submit_reads_into` lands each object in its target: the disk reads the file into it, the
    host copies the bytes it keeps, a store with neither has its payload copied in on the mover's
    thread; events carry no payload, a miss is ok=False, and a store that raises fails the batch,
    not the thread."""
    _, layout = _pool_layout(8)
    plain = _PlainStore(HostStore(1 << 20))
    host = HostStore(1 << 20)
    for store, positions in ((disk, (0, 1)), (host, (2, 3)), (plain, (5, 6))):
        store.put("kv-a", _object(layout, 1))
        store.put("kv-b", _object(layout, 2))
        mover = StoreMover(store)  # type: ignore[arg-type]
        assert mover.reads_in_place == (store is not plain)
        try:
            reads = [(key, tier_store.ReadTarget(layout, position))
                     for key, position in (("kv-a", positions[0]), ("kv-none", 4), ("kv-b", positions[1]))]
            first = mover.submit_reads_into(reads)
            assert first is not None
            events = _collect(mover, 3)
            assert [(e.seq - first, e.key, e.ok, e.payload) for e in events] == [
                (0, "kv-a", True, None), (1, "kv-none", False, None), (2, "kv-b", True, None)]
            assert events[0].nbytes == layout.nbytes and events[1].nbytes == 0
            _assert_same(layout.tensors_of(positions[0]), _object(layout, 1))
            _assert_same(layout.tensors_of(positions[1]), _object(layout, 2))

            def broken(*args: Any) -> list[Any]:
                raise OSError("store went away")

            setattr(store, "get" if store is plain else "get_many_into", broken)
            mover.submit_reads_into(reads[:1])
            assert [(e.key, e.ok) for e in _collect(mover, 1)] == [("kv-a", False)]
        finally:
            mover.close()


def test_host_reads_in_place_copy_the_bytes_kept_with_each_object() -> None:
    """The host store copies an object into a read target from the bytes it keeps beside it; an
    object of another layout, a deleted or a replaced one is judged by what it holds now, and
    misses are counted."""
    _, layout = _pool_layout()
    host = HostStore(1 << 20)
    host.put("kv-a", _object(layout, 1))
    host.put("kv-b", _object(layout, 2))
    host.put("kv-wrong", {**_object(layout, 3), "keys": _object(layout, 3)["keys"][:, :2]})
    targets = [tier_store.ReadTarget(layout, position) for position in range(4)]
    assert host.get_many_into(["kv-a", "kv-b", "kv-wrong", "kv-none"], targets) == [True, True, False, False]
    _assert_same(layout.tensors_of(0), _object(layout, 1))
    _assert_same(layout.tensors_of(1), _object(layout, 2))
    assert not layout.tensors_of(2)["values"].any()  # the wrong object wrote nothing
    host.put("kv-a", _object(layout, 4))  # replaced: the bytes kept are the new object's
    host.delete("kv-b")
    assert host.get_many_into(["kv-a", "kv-b"], targets[2:]) == [True, False]
    _assert_same(layout.tensors_of(2), _object(layout, 4))
    stats = host.stats()
    assert (stats.gets, stats.hits, stats.misses) == (6, 3, 3)


def test_cpu_device_pools_take_reads_in_place_where_their_blocks_lie() -> None:
    """A CPU pool's read target is the block's or slot's own memory: an object copied in (or read
    into its byte views) is what the pool then holds there."""
    kv, snapshots, pools = _device_pools()
    block = pools.read_many("kv", [4]).payloads[0]
    target = pools.read_target("kv", 1)
    assert target is not None and tier_store.copy_into(target, block)
    assert torch.equal(kv.keys[:, 4:8], kv.keys[:, 16:20]) and torch.equal(kv.values[:, 4:8], kv.values[:, 16:20])
    state = pools.read_target("state", 2)
    assert state is not None
    for view in state.layout.byte_views(state.position):
        view[:] = bytes(len(view))
    assert not snapshots.conv[:, 2].any() and not snapshots.recurrent[:, 2].any() and snapshots.conv[:, 1].any()
    assert not tier_store.copy_into(target, {**block, "keys": block["keys"][:, :2]})

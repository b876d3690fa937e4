"""The CPU engine's heap by step kind (engine/memory.py): a prefill step maps its large allocations on
their own, returned to the system when freed, so prompt-sized activations never become heap a
serving process keeps; a decode step reuses the kept heap."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from hybridserve import SamplingParams
from hybridserve.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridserve.engine import memory
from hybridserve.engine import worker as worker_module
from hybridserve.engine.engine import LLMEngine

MMAP_THRESHOLD = -3  # glibc's M_MMAP_THRESHOLD


class _RecordingLibc:
    """Stands in for glibc: records mallopt calls and accepts them."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


@pytest.fixture
def recording_libc(monkeypatch: pytest.MonkeyPatch) -> _RecordingLibc:
    libc = _RecordingLibc()
    monkeypatch.setattr(memory, "_libc", lambda: libc)
    monkeypatch.setattr(memory, "_heap_mode", memory._HeapMode())
    return libc


def test_step_threshold_maps_prefill_allocations_and_keeps_decode_ones() -> None:
    assert memory.step_mmap_threshold(prefills=True) < (1 << 20) < memory.step_mmap_threshold(prefills=False)


def test_prepare_step_heap_sets_the_threshold_only_when_the_step_kind_changes(recording_libc: _RecordingLibc) -> None:
    assert memory.retain_freed_activation_memory()
    recording_libc.calls.clear()
    changed = [memory.prepare_step_heap(kind) for kind in (False, True, True, False, False, True)]
    assert changed == [False, True, False, True, False, True]
    assert recording_libc.calls == [(MMAP_THRESHOLD, memory.step_mmap_threshold(True)),
                                    (MMAP_THRESHOLD, memory.step_mmap_threshold(False)),
                                    (MMAP_THRESHOLD, memory.step_mmap_threshold(True))]


def test_prepare_step_heap_leaves_an_allocator_it_does_not_manage_alone(recording_libc: _RecordingLibc) -> None:
    # no serving thresholds (a CUDA engine, or during start-up's loading): nothing to switch
    assert not memory.prepare_step_heap(True)
    with memory.freed_memory_returned():
        recording_libc.calls.clear()
        assert not memory.prepare_step_heap(True)
        assert recording_libc.calls == []
    assert memory.prepare_step_heap(True)  # leaving restored the serving thresholds


def test_the_engine_prepares_each_step_by_its_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32",
                                    cache=CacheConfig(kv_cache_mib=8, prefix_cache_mib=0),
                                    scheduler=SchedulerConfig(max_num_seqs=2, max_model_len=256)))
    kinds: list[bool] = []

    def record(prefills: bool) -> bool:
        kinds.append(prefills)
        return False

    monkeypatch.setattr(worker_module, "prepare_step_heap", record)
    engine.add_request("r", list(range(300, 340)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert kinds == [True, False, False, False]


PROBE = """
import ctypes, json, torch
from hybridserve.engine import memory
def mapped():  # bytes glibc holds in mappings of their own (mallinfo2().hblkhd)
    libc = memory._libc(); libc.mallinfo2.restype = memory._MallInfo2
    return libc.mallinfo2().hblkhd
out = {"serving": memory.retain_freed_activation_memory()}
for kind in ("prefill", "decode"):
    memory.prepare_step_heap(kind == "prefill")
    before = mapped()
    tensor = torch.ones(1 << 20)  # 4 MiB
    out[kind + "_mapped"] = mapped() - before
    free_before = memory.allocator_free_bytes()
    del tensor
    out[kind + "_kept_after_free"] = memory.allocator_free_bytes() - free_before
    out[kind + "_mapped_after_free"] = mapped() - before
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_glibc_maps_a_prefill_steps_tensor_and_keeps_a_decode_steps_in_the_heap() -> None:
    """In a fresh interpreter (the thresholds are process-wide): what glibc does with a 4 MiB tensor."""
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    out = SimpleNamespace(**json.loads(done.stdout.strip().splitlines()[-1]))
    if not out.serving:
        pytest.skip("mallopt is not glibc's here")
    assert out.prefill_mapped >= 4 << 20 and out.prefill_mapped_after_free == 0  # returned at once
    assert out.decode_mapped == 0 and out.decode_kept_after_free >= 4 << 20       # kept for the next step

"""Start-up memory planning: explicit sizes, a total split by share, a profiled memory fraction,
and models or pools that cannot fit failing at start-up with the numbers. CPU, float32."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridserve.engine.engine import LLMEngine
from hybridserve.engine.memory import allocator_free_bytes
from hybridserve.engine.memory_plan import MIB, device_memory, parse_size


def _engine(cache: CacheConfig, **scheduler) -> LLMEngine:
    return LLMEngine(EngineConfig(device="cpu", dtype="float32", cache=cache,
                                  scheduler=SchedulerConfig(**scheduler)))


@pytest.mark.parametrize("text, expected", [("1000", 1000), ("4GiB", 4 << 30), ("512MiB", 512 * MIB),
                                            ("1.5G", 1_500_000_000), ("2 kib", 2048)])
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "12 parsecs", "-1GiB", "GiB"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


def test_explicit_total_is_split_by_share_and_reported_in_bytes() -> None:
    engine = _engine(CacheConfig(kv_cache_memory_bytes=64 * MIB, snapshot_memory_share=0.25), max_model_len=4096)
    plan = engine.memory_plan
    assert plan.kv_bytes == 48 * MIB and plan.snapshot_bytes == 16 * MIB and plan.activation_bytes == 0
    assert engine.num_kv_blocks == 48 * MIB // engine.kv_bytes_per_block
    assert engine.num_snapshot_slots == 16 * MIB // engine.bytes_per_snapshot
    report = engine.prefix_cache_stats()
    assert report.kv_pool_bytes == engine.num_kv_blocks * engine.kv_bytes_per_block
    assert report.snapshot_pool_bytes == engine.num_snapshot_slots * engine.bytes_per_snapshot
    assert report.kv_used_bytes == 0
    engine.add_request("a", list(range(300, 400)), SamplingParams(max_tokens=2, temperature=0.0))
    engine.step()
    used = engine.prefix_cache_stats().kv_used_bytes
    assert used == engine.cache.block_pool.num_used_blocks * engine.kv_bytes_per_block > 0
    stats = engine.stats()
    assert stats["kv_pool_bytes"] == report.kv_pool_bytes and stats["weight_bytes"] == engine.weight_bytes
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    assert "snapshot share 0.25" in plan.describe() and "kv-cache-memory" in engine.describe()


PROFILE_SCRIPT = """
import json
from hybridserve.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridserve.engine.engine import LLMEngine
from hybridserve.engine.memory_plan import MIB, device_memory
import torch
available = device_memory(torch.device("cpu")).free_bytes
fraction = (112 * MIB + 128 * MIB) / available
engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", cache=CacheConfig(memory_fraction=fraction),
                                scheduler=SchedulerConfig(max_num_batched_tokens=512, max_model_len=4096)))
print(json.dumps({"fraction": fraction, **engine.memory_plan._asdict(), "kv_blocks": engine.num_kv_blocks}))
"""


def test_memory_fraction_profiles_a_forward_and_sizes_the_pools() -> None:
    """The fraction (of RAM available at start, on CPU) minus weights and the profiled activation
    peak goes to the pools; the fraction is chosen so that this leaves roughly 100 MiB. Run in a
    fresh process: the CPU peak is a resident-set peak, which a heap warmed by earlier tests hides."""
    done = subprocess.run([sys.executable, "-c", PROFILE_SCRIPT], capture_output=True, text=True, timeout=300,
                          check=True)
    plan = json.loads(done.stdout.strip().splitlines()[-1])
    assert plan["source"].startswith("memory fraction")
    assert plan["activation_bytes"] > 0, "the profiled forward must have measured something"
    expected = int(plan["fraction"] * plan["available"]) - plan["weight_bytes"] - plan["activation_bytes"]
    assert abs(plan["kv_bytes"] + plan["snapshot_bytes"] - expected) <= 1
    assert plan["snapshot_bytes"] == int(expected * 0.5)
    assert plan["kv_blocks"] == plan["kv_bytes"] // (16 * 2048)


def test_explicit_pool_within_a_total_gets_the_rest() -> None:
    engine = _engine(CacheConfig(kv_cache_memory_bytes=64 * MIB, kv_cache_mib=40), max_model_len=4096)
    assert engine.memory_plan.kv_bytes == 40 * MIB and engine.memory_plan.snapshot_bytes == 24 * MIB
    with pytest.raises(ValueError, match=r"explicit pool sizes \(80\.0 MiB\) exceed"):
        _engine(CacheConfig(kv_cache_memory_bytes=64 * MIB, kv_cache_mib=80), max_model_len=4096)


def test_model_that_cannot_fit_fails_at_start_up_with_numbers() -> None:
    available = device_memory(__import__("torch").device("cpu")).free_bytes
    fraction = 50 * MIB / available  # less than the built-in model's 111 MiB of weights
    with pytest.raises(ValueError, match=r"does not fit: .* MiB, but the weights take 111\.3 MiB"):
        _engine(CacheConfig(memory_fraction=fraction), max_num_batched_tokens=64)


def test_kv_pool_too_small_for_one_full_length_request_fails_at_start_up() -> None:
    with pytest.raises(ValueError, match=r"cannot hold one request of max_model_len tokens \(2048 blocks"):
        _engine(CacheConfig(kv_cache_memory_bytes=8 * MIB))  # max_model_len 32768 needs 64 MiB of KV


def test_explicit_pools_larger_than_free_memory_fail_before_allocating() -> None:
    with pytest.raises(ValueError, match=r"the caches need .* MiB .* but only .* MiB of cpu memory are free"):
        LLM(device="cpu", dtype="float32", kv_cache_mib=float(1 << 30), prefix_cache_mib=0)


@pytest.mark.parametrize("kwargs, message", [
    ({"memory_fraction": 0.0}, "memory_fraction"), ({"memory_fraction": 1.5}, "memory_fraction"),
    ({"snapshot_memory_share": 1.0}, "snapshot_memory_share"), ({"kv_cache_memory": "lots"}, "invalid size"),
    ({"block_hash": "md5"}, "block_hash"), ({"num_threads": 0}, "num_threads"),
])
def test_bad_memory_options_are_value_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(device="cpu", dtype="float32", **kwargs)


@pytest.mark.skipif(allocator_free_bytes() == 0, reason="needs glibc's mallinfo2 (2.33+)")
def test_allocator_free_bytes_counts_memory_freed_into_the_heap() -> None:
    blocks = [bytearray(64 << 10) for _ in range(400)]  # 64 KiB: served from the heap, not mmap
    before = allocator_free_bytes()  # after the allocations, which may have reused free memory
    del blocks[::2]  # every other one: the holes cannot merge into the heap's top and be trimmed
    assert allocator_free_bytes() - before >= 150 * (64 << 10)
    del blocks


def test_the_onednn_kernel_caches_are_capped_at_engine_start() -> None:
    """oneDNN keeps a kernel per GEMM shape (a prefill's row count changes every step): without a cap
    its caches grew a serving process by ~950 MiB in minutes (docs/benchmarks.md). The cap is set
    when an engine starts (`apply_process_settings`), before oneDNN builds its first kernel."""
    code = ("import os; from hybridserve.engine.threads import apply_process_settings; apply_process_settings(1); "
            "print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'], os.environ['LRU_CACHE_CAPACITY'])")
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["64", "64"]


def test_a_serving_process_freezes_its_startup_heap_and_still_collects_new_garbage() -> None:
    """`freeze_startup_heap` (called by the engine core and the API server once built) moves what is
    alive to the collector's permanent generation; cycles made afterwards are still collected."""
    code = """if True:
        import gc, weakref
        from hybridserve.engine.memory import freeze_startup_heap
        class Node:
            pass
        kept = Node(); kept.self = kept
        frozen = freeze_startup_heap()
        late = Node(); late.self = late; alive = weakref.ref(late); del late
        gc.collect()
        print(frozen, gc.get_freeze_count() >= frozen, alive() is None, kept.self is kept)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) > 1000 and out[1:] == ["True", "True", "True"]

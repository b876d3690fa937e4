"""Default CPU pools sized to the model and the machine (issue 36, item 10): the RAM probe reads
/proc/meminfo and the memory cgroup (v1 and v2, the tightest level), and the default pools take
what max_num_seqs full-length requests can use, within a fraction of the RAM available after the
weights, never less KV than one max_model_len request. Machine sizes are faked through the probe's
paths and `PlanInputs`; explicit sizes still win."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridserve.config import (
    DEFAULT_CPU_KV_CACHE_MIB,
    DEFAULT_CPU_PREFIX_CACHE_MIB,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)
from hybridserve.engine.engine import LLMEngine
from hybridserve.engine.memory_plan import (
    DEFAULT_CPU_CACHE_FRACTION,
    MIB,
    SNAPSHOTS_PER_SEQUENCE,
    DeviceMemory,
    MemoryPlan,
    PlanInputs,
    cgroup_memory_limit,
    cpu_memory,
    plan_memory,
)

GIB = 1 << 30
KV_PER_BLOCK = 16 * 2048           # the built-in model: 2 KiB of KV per token, 16-token blocks
PER_SNAPSHOT = 860_160             # the built-in model's GDN snapshot
WEIGHTS = 111 * MIB
CPU = torch.device("cpu")


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_machine(tmp_path: Path, total_kib: int, available_kib: int, cgroup: str,
                 files: dict[str, str]) -> dict[str, str]:
    """Paths for `cpu_memory`: a meminfo, a /proc/self/cgroup and a cgroup tree holding `files`."""
    write(tmp_path / "meminfo", f"MemTotal:       {total_kib} kB\nMemFree:        1000 kB\n"
                                f"MemAvailable:   {available_kib} kB\nHugePages_Total:       0\n")
    write(tmp_path / "cgroup", cgroup)
    for name, text in files.items():
        write(tmp_path / "fs" / name, text)
    return {"meminfo": str(tmp_path / "meminfo"), "proc_cgroup": str(tmp_path / "cgroup"),
            "cgroup_root": str(tmp_path / "fs")}


def test_a_v2_cgroup_limit_below_the_host_memory_bounds_the_probe(tmp_path: Path) -> None:
    paths = fake_machine(tmp_path, 64 << 20, 60 << 20, "0::/\n", {
        "cgroup.controllers": "cpu memory\n", "memory.max": f"{4 * GIB}\n", "memory.current": f"{GIB}\n",
        "memory.stat": f"anon 100\ninactive_file {256 * MIB}\nactive_file 5\n"})
    assert cpu_memory(**paths) == DeviceMemory(4 * GIB, 4 * GIB - (GIB - 256 * MIB))


def test_a_v2_cgroup_without_a_limit_leaves_the_host_figures(tmp_path: Path) -> None:
    paths = fake_machine(tmp_path, 64 << 20, 60 << 20, "0::/job\n", {
        "cgroup.controllers": "memory\n", "job/memory.max": "max\n", "job/memory.current": "5\n"})
    assert cgroup_memory_limit(paths["proc_cgroup"], paths["cgroup_root"]) is None
    assert cpu_memory(**paths) == DeviceMemory(64 * GIB, 60 * GIB)


def test_a_v1_parent_limit_tighter_than_its_child_wins(tmp_path: Path) -> None:
    cgroup = "4:memory:/pod/box\n3:cpu,cpuacct:/pod/box\n0::/\n"
    paths = fake_machine(tmp_path, 32 << 20, 30 << 20, cgroup, {
        "memory/pod/box/memory.limit_in_bytes": f"{8 * GIB}\n", "memory/pod/box/memory.usage_in_bytes": f"{GIB}\n",
        "memory/pod/memory.limit_in_bytes": f"{2 * GIB}\n", "memory/pod/memory.usage_in_bytes": f"{GIB}\n",
        "memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "7\n"})
    assert cpu_memory(**paths) == DeviceMemory(2 * GIB, GIB)


def test_without_cgroup_files_the_probe_reads_meminfo(tmp_path: Path) -> None:
    paths = fake_machine(tmp_path, 16 << 20, 12 << 20, "0::/\n", {})
    paths["proc_cgroup"] = str(tmp_path / "missing")
    assert cpu_memory(**paths) == DeviceMemory(16 * GIB, 12 * GIB)


def plan(available: int, max_model_len: int = 32768, max_num_seqs: int = 32, ranks: int = 1,
         free_now: int | None = None, **cache: float) -> MemoryPlan:
    """The plan for the built-in model's sizes on a machine with `available` bytes free at start."""
    config = CacheConfig(**cache)  # type: ignore[arg-type]
    blocks = -(-max_model_len // config.block_size)
    free = free_now if free_now is not None else available - WEIGHTS

    def probe(device: torch.device) -> DeviceMemory:
        return DeviceMemory(available, free)

    inputs = PlanInputs(CPU, DeviceMemory(available, available), WEIGHTS, KV_PER_BLOCK, PER_SNAPSHOT, blocks,
                        max_num_seqs=max_num_seqs, ranks_per_host=ranks, memory_probe=probe)
    return plan_memory(config, inputs, lambda: 0)


def test_a_large_machine_gets_the_ceilings_for_a_long_context() -> None:
    sized = plan(64 * GIB)
    assert (sized.kv_bytes, sized.snapshot_bytes) == (int(DEFAULT_CPU_KV_CACHE_MIB * MIB),
                                                      int(DEFAULT_CPU_PREFIX_CACHE_MIB * MIB))
    assert sized.source.startswith("CPU defaults") and sized.activation_bytes == 0


def test_a_short_context_and_few_sequences_get_only_what_they_can_use() -> None:
    sized = plan(64 * GIB, max_model_len=2048, max_num_seqs=4)
    assert sized.kv_bytes == 4 * 128 * KV_PER_BLOCK  # four full-length requests: 16 MiB
    assert sized.snapshot_bytes == 4 * (2048 // 256 + SNAPSHOTS_PER_SEQUENCE) * PER_SNAPSHOT


def test_a_small_container_gets_a_fraction_of_what_the_weights_leave() -> None:
    available = 1 * GIB
    cap = int(DEFAULT_CPU_CACHE_FRACTION * (available - WEIGHTS))
    sized = plan(available)
    assert sized.kv_bytes + sized.snapshot_bytes <= cap
    assert sized.kv_bytes == int(cap * 0.5) and sized.snapshot_bytes == cap - sized.kv_bytes  # split by share
    assert "0.5 of the 913 MiB of RAM available after 111.0 MiB of weights" in sized.source
    halved = plan(available, ranks=2)  # two tensor-parallel ranks share the host
    assert halved.kv_bytes + halved.snapshot_bytes <= int(DEFAULT_CPU_CACHE_FRACTION * (available - 2 * WEIGHTS)) // 2


def test_the_kv_pool_never_drops_below_one_full_length_request() -> None:
    one_request = 2048 * KV_PER_BLOCK  # 32768 tokens: 64 MiB
    cap = 100 * MIB  # half of it is below one request: the KV floor wins, the snapshots get the rest
    sized = plan(WEIGHTS + int(cap / DEFAULT_CPU_CACHE_FRACTION))
    assert sized.kv_bytes == one_request and sized.snapshot_bytes == cap - one_request
    with pytest.raises(ValueError, match=r"one request of max_model_len tokens needs 64\.0 MiB of KV cache "
                                         r"\(2048 blocks\), but the default CPU pools may take 50\.0 MiB"):
        plan(WEIGHTS + int(50 * MIB / DEFAULT_CPU_CACHE_FRACTION))
    with pytest.raises(ValueError, match="no room for one GDN snapshot"):
        plan(WEIGHTS + int((one_request + PER_SNAPSHOT // 2) / DEFAULT_CPU_CACHE_FRACTION))
    small = plan(WEIGHTS + int(one_request / DEFAULT_CPU_CACHE_FRACTION), prefix_cache_mib=0)
    assert (small.kv_bytes, small.snapshot_bytes) == (one_request, 0)


def test_explicit_sizes_win_and_the_other_pool_gets_the_rest() -> None:
    available = 1 * GIB
    cap = int(DEFAULT_CPU_CACHE_FRACTION * (available - WEIGHTS))
    both = plan(available, kv_cache_mib=2048, prefix_cache_mib=16, free_now=8 * GIB)
    assert (both.kv_bytes, both.snapshot_bytes, both.source) == (2048 * MIB, 16 * MIB, "explicit pool sizes")
    kv_given = plan(available, kv_cache_mib=100)
    assert kv_given.kv_bytes == 100 * MIB and kv_given.snapshot_bytes == cap - 100 * MIB
    snap_given = plan(64 * GIB, prefix_cache_mib=8)
    assert snap_given.snapshot_bytes == 8 * MIB and snap_given.kv_bytes == int(DEFAULT_CPU_KV_CACHE_MIB * MIB)
    with pytest.raises(ValueError, match="only 200.0 MiB of cpu memory are free"):
        plan(available, kv_cache_mib=300, prefix_cache_mib=0, free_now=200 * MIB)


def test_an_engine_left_to_its_defaults_sizes_its_pools_for_its_requests() -> None:
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", cache=CacheConfig(),
                                    scheduler=SchedulerConfig(max_model_len=1024, max_num_seqs=4)))
    assert engine.num_kv_blocks == 4 * 64
    assert engine.num_snapshot_slots == 4 * (1024 // 256 + SNAPSHOTS_PER_SEQUENCE)
    assert "CPU defaults for the model and the machine" in engine.describe()

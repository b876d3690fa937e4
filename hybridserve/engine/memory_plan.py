"""Start-up memory planning of the KV and snapshot pools (docs/prefix-cache.md, Memory plan)."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from hybridserve.config import DEFAULT_CPU_KV_CACHE_MIB, DEFAULT_CPU_PREFIX_CACHE_MIB, MIB, CacheConfig, parse_size  # noqa: F401 - parse_size re-exported for callers

if TYPE_CHECKING:
    from hybridserve.models.qwen3_5 import Qwen3_5ForCausalLM

logger = logging.getLogger(__name__)
DEFAULT_CUDA_MEMORY_FRACTION = 0.9
# CPU pools when none is given: at most this share of the memory available after the weights (a
# CPU server shares its RAM), at most what max_num_seqs full-length requests can use, at most the
# DEFAULT_CPU_*_MIB ceilings, and never less KV than one max_model_len request
DEFAULT_CPU_CACHE_FRACTION = 0.5
SNAPSHOTS_PER_SEQUENCE = 3  # besides interval marks: its prompt mark, end and a branch point
UNLIMITED = 1 << 60         # a cgroup limit at or above this is no limit (v1 writes 2**63 rounded to a page)


class DeviceMemory(NamedTuple):
    """Memory of the serving device: total and currently free/available bytes."""

    total_bytes: int
    free_bytes: int


class MemoryPlan(NamedTuple):
    """The resolved cache sizes and the measurements they came from (all bytes)."""

    source: str               # how the sizes were chosen
    device_total: int         # device memory (CUDA) or RAM (CPU)
    available: int            # free when the engine started (CUDA free memory / CPU MemAvailable)
    weight_bytes: int
    activation_bytes: int     # profiled peak of one max-size forward (0 when not profiled)
    kv_bytes: int
    snapshot_bytes: int
    snapshot_share: float     # fraction of the cache memory given to snapshots

    @property
    def cache_bytes(self) -> int:
        """KV pool plus snapshot pool."""
        return self.kv_bytes + self.snapshot_bytes

    def describe(self) -> str:
        """One line for the start-up log."""
        return (f"memory plan ({self.source}): weights {self.weight_bytes / MIB:.1f} MiB, activation peak "
                f"{self.activation_bytes / MIB:.1f} MiB, cache {self.cache_bytes / MIB:.1f} MiB = KV "
                f"{self.kv_bytes / MIB:.1f} MiB + snapshots {self.snapshot_bytes / MIB:.1f} MiB "
                f"(snapshot share {self.snapshot_share:.2f}); device {self.device_total / MIB:.0f} MiB, "
                f"{self.available / MIB:.0f} MiB available at start")


def device_memory(device: torch.device) -> DeviceMemory:
    """Total and free bytes of `device` (CUDA: the allocator's view; CPU: `cpu_memory`)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(int(total), int(free))
    return cpu_memory()


def cpu_memory(meminfo: str = "/proc/meminfo", proc_cgroup: str = "/proc/self/cgroup",
               cgroup_root: str = "/sys/fs/cgroup") -> DeviceMemory:
    """RAM this process may use: /proc/meminfo's MemTotal and MemAvailable, each lowered to this
    process's memory cgroup limit and the room left under it when one is set (a container)."""
    info = _proc_bytes(meminfo)
    total, available = info["MemTotal"], info.get("MemAvailable", info["MemFree"])
    limit = cgroup_memory_limit(proc_cgroup, cgroup_root)
    if limit is not None:
        total, available = min(total, limit.total_bytes), min(available, limit.free_bytes)
    return DeviceMemory(total, available)


def cgroup_memory_limit(proc_cgroup: str = "/proc/self/cgroup",
                        cgroup_root: str = "/sys/fs/cgroup") -> DeviceMemory | None:
    """The tightest memory limit over this process's cgroup and its ancestors, with the room left
    under it (the limit less the usage, reclaimable inactive file pages not counted); cgroup v2
    (`memory.max`) or v1 (`memory.limit_in_bytes`). None when no level sets one."""
    try:
        with open(proc_cgroup) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    tightest: DeviceMemory | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy, mounted at the root (or at unified/ beside v1)
            unified = cgroup_root if os.path.exists(os.path.join(cgroup_root, "cgroup.controllers")) \
                else os.path.join(cgroup_root, "unified")
            files = (unified, "memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            files = (os.path.join(cgroup_root, "memory"), "memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        for level in _cgroup_levels(files[0], path):
            found = _cgroup_level_limit(level, files[1], files[2])
            if found is not None and (tightest is None or found.free_bytes < tightest.free_bytes):
                tightest = found
    return tightest


def _cgroup_levels(mount: str, path: str) -> list[str]:
    """The directories of cgroup `path` under `mount`, then of each ancestor up to the mount."""
    parts = [part for part in path.split("/") if part]
    return [os.path.join(mount, *parts[:depth]) for depth in range(len(parts), -1, -1)]


def _cgroup_level_limit(directory: str, limit_file: str, usage_file: str) -> DeviceMemory | None:
    """(limit, room under it) of one cgroup directory; None when it sets no limit or is unreadable."""
    try:
        with open(os.path.join(directory, limit_file)) as handle:
            text = handle.read().strip()
        if text == "max" or int(text) >= UNLIMITED:
            return None
        with open(os.path.join(directory, usage_file)) as handle:
            usage = int(handle.read().strip())
    except (OSError, ValueError):
        return None
    limit = int(text)
    reclaimable = 0
    try:
        with open(os.path.join(directory, "memory.stat")) as handle:
            for line in handle:
                name, _, value = line.partition(" ")
                if name == "inactive_file":
                    reclaimable = int(value)
    except (OSError, ValueError):
        pass
    return DeviceMemory(limit, max(0, limit - max(0, usage - reclaimable)))


def _proc_bytes(path: str) -> dict[str, int]:
    """The numeric `Name: value kB` fields of a /proc file, in bytes."""
    values = {}
    with open(path) as handle:
        for line in handle:
            name, _, rest = line.partition(":")
            if (fields := rest.split()) and fields[0].isdigit():
                values[name] = int(fields[0]) * 1024
    return values


def measure_peak(device: torch.device, run: Callable[[], object]) -> int:
    """Peak memory growth while `run()` executes: CUDA allocator peak, or CPU resident-set peak."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - base)
    base = _proc_bytes("/proc/self/status")["VmRSS"]
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # reset VmHWM to the current resident set
    except OSError:
        logger.warning("cannot reset the peak RSS; the activation estimate may be low")
    run()
    return max(0, _proc_bytes("/proc/self/status")["VmHWM"] - base)


class PlanInputs(NamedTuple):
    """What planning needs besides the cache config."""

    device: torch.device
    memory_at_start: DeviceMemory      # measured before the weights were loaded
    weight_bytes: int
    kv_bytes_per_block: int
    bytes_per_snapshot: int
    min_kv_blocks: int                 # blocks one request of max_model_len tokens needs
    max_num_seqs: int = 1              # sequences that run at once (what default CPU pools can use)
    ranks_per_host: int = 1            # tensor-parallel ranks that share this host's RAM (CPU)
    memory_probe: Callable[[torch.device], DeviceMemory] = device_memory  # free memory now (a test seam)


def plan_memory(cache: CacheConfig, inputs: PlanInputs, profile: Callable[[], int]) -> MemoryPlan:
    """Resolve the pool sizes (ValueError with numbers if they cannot fit); `profile()` measures a forward."""
    start = inputs.memory_at_start
    share = cache.snapshot_memory_share if cache.prefix_cache_mib != 0 else 0.0
    explicit_kv = None if cache.kv_cache_mib is None else int(cache.kv_cache_mib * MIB)
    explicit_snap = None if cache.prefix_cache_mib is None else int(cache.prefix_cache_mib * MIB)
    activation = 0
    total: int | None = None
    if explicit_kv is not None and explicit_snap is not None:
        source = "explicit pool sizes"
    elif cache.kv_cache_memory_bytes is not None:
        total, source = cache.kv_cache_memory_bytes, "kv-cache-memory"
    elif cache.memory_fraction is not None or inputs.device.type == "cuda":
        fraction = cache.memory_fraction if cache.memory_fraction is not None else DEFAULT_CUDA_MEMORY_FRACTION
        activation = profile()
        total = _fraction_budget(fraction, start, inputs, activation)
        source = f"memory fraction {fraction:g}"
    if total is not None:
        kv, snap = _split(total, explicit_kv, explicit_snap, share)
    else:
        kv, snap, source = _cpu_default_pools(cache, inputs, explicit_kv, explicit_snap)
    plan = MemoryPlan(source, start.total_bytes, start.free_bytes, inputs.weight_bytes, activation,
                      kv, snap, share if total is not None else snap / max(1, kv + snap))
    _check(plan, inputs, derived=total is not None and explicit_kv is None)
    return plan


def _fraction_budget(fraction: float, start: DeviceMemory, inputs: PlanInputs, activation: int) -> int:
    """Cache bytes: the fraction of CUDA memory (of RAM available on CPU) less weights and activations."""
    base = start.total_bytes if inputs.device.type == "cuda" else start.free_bytes
    requested = int(fraction * base)
    if inputs.device.type == "cuda" and requested > start.free_bytes:
        raise ValueError(f"--memory-fraction {fraction:g} asks for {requested / MIB:.0f} MiB of "
                         f"{start.total_bytes / MIB:.0f} MiB device memory, but only {start.free_bytes / MIB:.0f} "
                         f"MiB were free at start-up; lower --memory-fraction")
    budget = requested - inputs.weight_bytes - activation
    if budget <= 0:
        raise ValueError(f"the model does not fit: memory fraction {fraction:g} gives {requested / MIB:.1f} MiB, "
                         f"but the weights take {inputs.weight_bytes / MIB:.1f} MiB and a forward of "
                         f"max_num_batched_tokens needs {activation / MIB:.1f} MiB more, leaving nothing for the "
                         f"KV cache; raise --memory-fraction, lower --max-num-batched-tokens, or use a "
                         f"device with more memory")
    return budget


def _cpu_default_pools(cache: CacheConfig, inputs: PlanInputs, kv: int | None,
                       snap: int | None) -> tuple[int, int, str]:
    """(KV bytes, snapshot bytes, source) on CPU without a total: an explicit pool size wins; a
    pool left unset gets what max_num_seqs requests of max_model_len tokens can use, at most its
    DEFAULT_CPU_*_MIB ceiling, the two together within DEFAULT_CPU_CACHE_FRACTION of the RAM
    available after the weights (split by `snapshot_memory_share` when that binds); the KV pool
    never below one max_model_len request (ValueError when that does not fit)."""
    if kv is not None and snap is not None:
        return kv, snap, "explicit pool sizes"
    start, ranks = inputs.memory_at_start, max(1, inputs.ranks_per_host)
    after_weights = max(0, start.free_bytes - inputs.weight_bytes * ranks)
    cap = int(DEFAULT_CPU_CACHE_FRACTION * after_weights) // ranks
    one_request = inputs.min_kv_blocks * inputs.kv_bytes_per_block
    max_tokens = inputs.min_kv_blocks * cache.block_size
    useful_snapshots = inputs.max_num_seqs * (max_tokens // cache.snapshot_interval + SNAPSHOTS_PER_SEQUENCE)
    default_kv = max(one_request, min(inputs.max_num_seqs * one_request, int(DEFAULT_CPU_KV_CACHE_MIB * MIB)))
    default_snap = min(useful_snapshots * inputs.bytes_per_snapshot, int(DEFAULT_CPU_PREFIX_CACHE_MIB * MIB))
    room = cap - (kv or 0) - (snap or 0)  # what the unset pools may take together
    kv_unset, snap_unset = kv is None, snap is None
    if kv is None and snap is None:
        kv = min(default_kv, max(one_request, int(room * (1 - cache.snapshot_memory_share))))
        snap = min(default_snap, room - kv)
    elif kv is None:
        kv = min(default_kv, max(one_request, room))
    else:
        snap = min(default_snap, room)
    assert kv is not None and snap is not None
    machine = (f"{DEFAULT_CPU_CACHE_FRACTION:g} of the {after_weights / MIB:.0f} MiB of RAM available after "
               f"{inputs.weight_bytes * ranks / MIB:.1f} MiB of weights")
    if ranks > 1:
        machine += f", shared by {ranks} ranks"
    if kv_unset and kv > room:  # even the floor does not fit
        raise ValueError(f"one request of max_model_len tokens needs {one_request / MIB:.1f} MiB of KV cache "
                         f"({inputs.min_kv_blocks} blocks), but the default CPU pools may take "
                         f"{max(0, room) / MIB:.1f} MiB ({machine}); lower --max-model-len, or give the pool "
                         f"sizes (--kv-cache-mib, --prefix-cache-mib, or --kv-cache-memory)")
    if snap_unset and snap < inputs.bytes_per_snapshot:
        raise ValueError(f"no room for one GDN snapshot ({inputs.bytes_per_snapshot / MIB:.2f} MiB) in the default "
                         f"CPU pools ({machine}, {kv / MIB:.1f} MiB of it KV); give the pool sizes "
                         f"(--kv-cache-mib, --prefix-cache-mib), or --prefix-cache-mib 0 to disable the prefix cache")
    return kv, max(0, snap), f"CPU defaults for the model and the machine, within {machine}"


def _split(total: int, kv: int | None, snap: int | None, share: float) -> tuple[int, int]:
    """Pool bytes from a total: explicit sizes win, the rest is split by `share`."""
    explicit = (kv or 0) + (snap or 0)
    if explicit > total:
        raise ValueError(f"the explicit pool sizes ({explicit / MIB:.1f} MiB) exceed the planned cache memory "
                         f"({total / MIB:.1f} MiB)")
    if kv is not None:
        return kv, total - kv
    if snap is not None:
        return total - snap, snap
    snapshot = int(total * share)
    return total - snapshot, snapshot


def _check(plan: MemoryPlan, inputs: PlanInputs, derived: bool) -> None:
    """Fail with numbers when the pools cannot work or cannot be allocated."""
    kv_blocks = plan.kv_bytes // inputs.kv_bytes_per_block
    if plan.kv_bytes <= 0 or kv_blocks < 1:
        raise ValueError(f"the KV pool gets {plan.kv_bytes / MIB:.2f} MiB, less than one block "
                         f"({inputs.kv_bytes_per_block} bytes); {plan.describe()}")
    if derived and kv_blocks < inputs.min_kv_blocks:
        raise ValueError(f"the KV pool ({plan.kv_bytes / MIB:.1f} MiB, {kv_blocks} blocks) cannot hold one request "
                         f"of max_model_len tokens ({inputs.min_kv_blocks} blocks, "
                         f"{inputs.min_kv_blocks * inputs.kv_bytes_per_block / MIB:.1f} MiB); raise "
                         f"--memory-fraction or --kv-cache-memory, or lower --max-model-len. {plan.describe()}")
    if 0 < plan.snapshot_bytes < inputs.bytes_per_snapshot:
        raise ValueError(f"the snapshot pool gets {plan.snapshot_bytes} bytes, smaller than one GDN snapshot "
                         f"({inputs.bytes_per_snapshot} bytes for this model); give it more memory or use "
                         f"prefix_cache_mib=0 to disable the prefix cache")
    free_now = inputs.memory_probe(inputs.device).free_bytes
    if plan.cache_bytes > free_now:
        raise ValueError(f"the caches need {plan.cache_bytes / MIB:.1f} MiB (KV {plan.kv_bytes / MIB:.1f} + snapshots "
                         f"{plan.snapshot_bytes / MIB:.1f}) but only {free_now / MIB:.1f} MiB of "
                         f"{inputs.device.type} memory are free after loading {plan.weight_bytes / MIB:.1f} MiB "
                         f"of weights; lower the cache sizes or --memory-fraction")


def profile_forward(model: Qwen3_5ForCausalLM, num_tokens: int, block_size: int, dtype: torch.dtype,
                    device: torch.device) -> int:
    """Activation peak (bytes) of one prefill of `num_tokens` tokens, on a temporary runner."""
    from hybridserve.engine.runner import ModelRunner
    from hybridserve.engine.step_plan import PlanChunk, PlanRestore, StepPlan

    num_blocks = -(-num_tokens // block_size)
    runner = ModelRunner(model, num_kv_blocks=num_blocks, block_size=block_size, num_state_slots=1,
                         num_snapshot_slots=0, dtype=dtype, device=device)
    chunk = PlanChunk(token_ids=[0] * num_tokens, start=0, block_ids=list(range(num_blocks)), state_slot=0,
                      captures=[], samples=True, keep_prompt_logits=False)
    step = StepPlan([chunk], [PlanRestore(0, None, None)])
    peak = measure_peak(device, functools.partial(runner.execute_plan, step))
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return peak

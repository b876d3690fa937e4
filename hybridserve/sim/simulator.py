"""Replay a trace through the real scheduler and joint cache manager with an accounting-only runner
(no model, no tensors), one request at a time in trace order as `bench trace` replays it live."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from tqdm import tqdm

from hybridserve.cache.block_pool import BlockPool
from hybridserve.cache.manager import JointCacheManager
from hybridserve.cache.policy import make_policy
from hybridserve.cache.snapshots import SnapshotPool
from hybridserve.cache.state_slots import StateSlotPool
from hybridserve.cache.tiers import DEVICE, ObjectSizes, TieredCache, TierObject, TierSpec
from hybridserve.config import SchedulerConfig
from hybridserve.engine.request import Request
from hybridserve.engine.scheduler import Scheduler, blocks_for
from hybridserve.sampling_params import SamplingParams
from hybridserve.sim.links import DISK_LINK, HOST_LINK, Link
from hybridserve.sim.shapes import ModelShape
from hybridserve.sim.trace import TraceTokens


class SimConfig(NamedTuple):
    """One simulated cache: a policy under a KV and a snapshot budget (bytes), and lower tiers
    (host, disk: joint entries of state and KV, each with a byte budget; 0 = no such tier)."""

    policy: str
    kv_bytes: int
    snapshot_bytes: int
    block_size: int = 16
    interval: int = 256
    host_bytes: int = 0
    disk_bytes: int = 0
    host_link: Link = HOST_LINK
    disk_link: Link = DISK_LINK
    write_through: bool = True


class SimMover:
    """The simulator's `TierMover`: every transfer completes at the next poll; it adds up the time
    each would take on its link (promotions delay their request; demotions run beside the batch)."""

    def __init__(self, links: dict[str, Link]) -> None:
        self.links = links
        self.promotion_seconds = 0.0
        self.demotion_seconds = 0.0
        self._done: list[tuple[int, bool]] = []

    def _seconds(self, objects: Sequence[TierObject], tier: str) -> float:
        """One transfer per tier an object comes from (or goes to), at that tier's link."""
        by_tier: dict[str, int] = {}
        for obj in objects:
            far = obj.source if obj.source != DEVICE else tier
            by_tier[far] = by_tier.get(far, 0) + obj.nbytes
        return sum(self.links[name].seconds(nbytes) for name, nbytes in by_tier.items())

    def start_demotion(self, ticket: int, tier: str, objects: Sequence[TierObject], device_kept: bool = False) -> None:
        """Count the copy down to `tier`."""
        self.demotion_seconds += self._seconds(objects, tier)
        self._done.append((ticket, True))

    def reusing(self, kind: str, indices: Sequence[int]) -> None:
        """Nothing is read late: every copy completed when it started."""

    def start_promotion(self, ticket: int, objects: Sequence[TierObject]) -> None:
        """Count the copy up to the device."""
        self.promotion_seconds += self._seconds(objects, DEVICE)
        self._done.append((ticket, True))

    def discard(self, tier: str, keys: Sequence[str]) -> None:
        """Nothing is stored."""

    def poll(self) -> list[tuple[int, bool]]:
        """Everything started so far is done."""
        done, self._done = self._done, []
        return done


class SimResult(NamedTuple):
    """What one replay measured."""

    config: SimConfig
    kv_blocks: int
    snapshot_slots: int
    requests: int
    skipped: int              # larger than the whole KV pool (the engine would refuse them)
    prompt_tokens: int
    hit_tokens: int
    hit_requests: int
    prefill_flops: float      # of every replayed prompt, from scratch
    saved_flops: float        # skipped by hits
    snapshot_evictions: int
    kv_evictions: int
    snapshots_published: int
    seconds: float
    hits: tuple[int, ...] = ()   # cached prompt tokens of each replayed request, in order
    tier_hit_tokens: tuple[tuple[str, int], ...] = ()  # (tier, hit tokens) with the device first
    promotion_seconds: float = 0.0   # transfer time of every promotion (on its request's path)
    demotion_seconds: float = 0.0    # transfer time of every demotion (beside the batch)

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens restored from the cache."""
        return self.hit_tokens / max(self.prompt_tokens, 1)


class AccountingRun:
    """The scheduler and cache manager of one replay; `serve` admits, prefills, decodes and finishes
    one request. `snapshot_pool` builds the snapshot pool from its slot count (the oracle's type)."""

    def __init__(self, config: SimConfig, shape: ModelShape,
                 snapshot_pool: Callable[[int], SnapshotPool] = SnapshotPool) -> None:
        if config.kv_bytes <= 0 or config.snapshot_bytes <= 0:
            raise ValueError("KV and snapshot budgets must be positive")
        cost = shape.cost
        self.kv_blocks = int(config.kv_bytes // (config.block_size * cost.kv_bytes_per_token))
        self.snapshot_slots = int(config.snapshot_bytes // cost.snapshot_bytes)
        if self.kv_blocks < 1 or self.snapshot_slots < 1:
            raise ValueError(f"budgets too small for {shape.name}: KV {config.kv_bytes} bytes "
                             f"({config.block_size * cost.kv_bytes_per_token} per block), snapshots "
                             f"{config.snapshot_bytes} bytes ({cost.snapshot_bytes} per snapshot)")
        policy = make_policy(config.policy, config.block_size, cost, config.interval)
        limits = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1 << 40,
                                 max_prefill_tokens_during_decode=0)
        self.blocks = BlockPool(self.kv_blocks)
        self.snapshots = snapshot_pool(self.snapshot_slots)
        specs = [TierSpec(name, budget) for name, budget in (("host", config.host_bytes), ("disk", config.disk_bytes))
                 if budget > 0]
        self.mover = SimMover({"host": config.host_link, "disk": config.disk_link})
        tiers = TieredCache(specs, ObjectSizes(cost.snapshot_bytes, config.block_size * cost.kv_bytes_per_token),
                            self.mover, config.write_through) if specs else None
        self.cache = JointCacheManager(config.block_size, self.blocks, StateSlotPool(1), self.snapshots, policy,
                                       tiers=tiers)
        self.scheduler = Scheduler(limits, self.cache)
        self.block_size = config.block_size

    def fits(self, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` fits the whole KV pool."""
        return blocks_for(num_tokens, self.block_size) <= self.kv_blocks

    def serve(self, request_id: str, prompt: list[int], output: list[int], stepwise: bool = False) -> int:
        """Admit, prefill, decode and finish one request; its cached prompt tokens. Decode runs as one
        chunk (same captures and blocks) or, `stepwise`, a token per step as in the engine."""
        request = Request(request_id, None, prompt, SamplingParams(max_tokens=len(output), ignore_eos=True))
        scheduler = self.scheduler
        scheduler.add(request)
        self._step()
        for token in output[:-1]:
            request.append_token(token)
            if stepwise:
                self._step()
        if len(output) > 1 and not stepwise:
            self._step()
        request.append_token(output[-1])
        capture = scheduler.finish(request, "length")
        if capture is not None:
            scheduler.complete_end_capture(capture, True)
        return request.num_cached_tokens or 0

    def _step(self) -> None:
        output = self.scheduler.schedule()
        assert len(output.chunks) == 1 and not output.preempted, "the simulator serves one request at a time"
        self.scheduler.apply(output, set())


def simulate(tokens: TraceTokens, shape: ModelShape, config: SimConfig, progress: bool = False,
             check: bool = False, stepwise: bool = False, run: AccountingRun | None = None,
             on_request: Callable[[int], None] | None = None) -> SimResult:
    """Replay `tokens`' requests under one cache configuration; `check` verifies every pool's
    integrity at the end. `run`: a prepared replay of `config` (default: a fresh one);
    `on_request(n)` is called before the n-th replayed request."""
    run = run or AccountingRun(config, shape)
    order = range(len(tokens.records))
    start = time.perf_counter()
    prompt_tokens = hit_tokens = hit_requests = skipped = 0
    total_flops = saved_flops = 0.0
    hits = []
    label = f"sim {config.policy} kv={config.kv_bytes / 2**30:g}GiB snap={config.snapshot_bytes / 2**30:g}GiB"
    for position, index in enumerate(tqdm(order, desc=label, disable=not progress, leave=False, mininterval=1.0)):
        prompt, output = tokens.prompt(index), tokens.output(index)
        if not run.fits(len(prompt) + len(output)):
            skipped += 1
            continue
        if on_request is not None:
            on_request(position)
        hit = run.serve(str(index), prompt, output, stepwise)
        hits.append(hit)
        prompt_tokens += len(prompt)
        hit_tokens += hit
        hit_requests += hit > 0
        total_flops += shape.cost.prefill_flops(len(prompt))
        saved_flops += shape.cost.prefill_flops(hit)
    if check:
        run.scheduler.check_integrity()
    snap = run.snapshots.stats()
    by_tier = tuple((tier.name, tier.hit_tokens) for tier in run.cache.tier_stats())
    return SimResult(config, run.kv_blocks, run.snapshot_slots, len(order) - skipped, skipped, prompt_tokens,
                     hit_tokens, hit_requests, total_flops, saved_flops, snap.evicted_total,
                     run.blocks.num_evictions, snap.published_total, time.perf_counter() - start, tuple(hits),
                     by_tier, run.mover.promotion_seconds, run.mover.demotion_seconds)


def ceiling_hit_tokens(tokens: TraceTokens) -> tuple[int, int]:
    """(hit tokens, prompt tokens) of an unbounded cache that keeps every computed state: per request
    the deepest prefix computed before (seen hash ids, or the turn it continues), at most prompt - 1.
    Builds prompts in order, so call it after or instead of a replay."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    size = tokens.block_tokens
    for index in range(len(tokens.records)):
        record = tokens.records[index]
        tokens.prompt(index)
        earlier = tokens.predecessor(index)
        depth = 0
        while depth < len(record.hash_ids) and record.hash_ids[:depth + 1] in seen:
            depth += 1
        best = min(depth * size, record.input_length)
        if earlier is not None:
            previous = tokens.records[earlier]
            best = max(best, previous.input_length + previous.output_length - 1)
        hit += min(best, record.input_length - 1)
        total += record.input_length
        seen.update(record.hash_ids[:i + 1] for i in range(len(record.hash_ids)))
        tokens.output(index)
    return hit, total

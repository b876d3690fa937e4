"""Replay a trace across N simulated replicas behind a router (`hybridserve sim --replicas N`): each
replica an `AccountingRun` with 1/N of the budgets, queues built from arrival times, loads in
prefill-token equivalents. The model and the routers: docs/prefix-cache.md, Simulator.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

from tqdm import tqdm

from hybridserve.routing.index import JointIndex
from hybridserve.routing.policy import LOAD_HALF_LIFE_S, RouterConfig, choose_replica
from hybridserve.routing.summary import encode_summary, hash_identity
from hybridserve.sim.routing_report import ROUTERS
from hybridserve.sim.shapes import ModelShape
from hybridserve.sim.simulator import AccountingRun, SimConfig
from hybridserve.sim.trace import TraceTokens

SINGLE = "single"  # the reference row: one replica holding the whole budget


class RoutingSimConfig(NamedTuple):
    """A routed replay: `replicas` replicas of `cache` (total budgets, split evenly) behind `router`."""

    cache: SimConfig
    replicas: int
    router: str
    summary_period: float = 1.0      # seconds of trace time between summary refreshes (joint)
    utilization: float = 0.7         # cold work / capacity of all replicas together
    load_half_life: float = LOAD_HALF_LIFE_S  # > 0: load adds the work sent recently, decayed (half-life, s)
    router_config: RouterConfig = RouterConfig()


class RoutingResult(NamedTuple):
    """What one routed replay measured."""

    config: RoutingSimConfig
    requests: int
    skipped: int                    # larger than one replica's KV pool
    prompt_tokens: int
    hit_tokens: int
    prefill_flops: float
    saved_flops: float
    work: tuple[float, ...]         # work served per replica (prefill-token equivalents)
    mean_wait: float                # seconds a request waited in its replica's queue, on average
    reasons: tuple[tuple[str, int], ...] = ()   # joint: decisions by reason
    predicted_exact: float = 0.0    # joint: share of requests whose hit equals the depth the router saw
    route_seconds: float = 0.0      # time spent choosing replicas (index lookups and policy)
    seconds: float = 0.0
    routes: tuple[int, ...] = ()    # the replica of each replayed request, in order

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens restored from a cache."""
        return self.hit_tokens / max(self.prompt_tokens, 1)

    @property
    def balance(self) -> float:
        """The busiest replica's work over the mean (1.0: perfectly even)."""
        mean = sum(self.work) / max(len(self.work), 1)
        return max(self.work) / mean if mean else 1.0


def split_budgets(config: SimConfig, replicas: int) -> SimConfig:
    """One replica's share of `config`'s budgets."""
    return config._replace(kv_bytes=config.kv_bytes // replicas, snapshot_bytes=config.snapshot_bytes // replicas,
                           host_bytes=config.host_bytes // replicas, disk_bytes=config.disk_bytes // replicas)


def service_rate(tokens: TraceTokens, replicas: int, utilization: float) -> float:
    """Work per second of one replica so the trace's cold work keeps `replicas` of them
    `utilization` busy over the trace's span."""
    records = tokens.records
    work = sum(r.input_length + r.output_length for r in records)
    span = max((records[-1].timestamp - records[0].timestamp) / 1000.0, 1.0)
    return work / (span * replicas * utilization)


def conversation_roots(tokens: TraceTokens, index: int, roots: dict[int, int]) -> int:
    """The first turn of request `index`'s conversation (`roots` caches earlier answers)."""
    earlier = tokens.predecessor(index)
    root = index if earlier is None else roots.get(earlier, earlier)
    roots[index] = root
    return root


def _stable_slot(value: int, count: int) -> int:
    """A well-spread, run-independent replica number for `value`."""
    mixed = (value * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & ((1 << 64) - 1)
    mixed ^= mixed >> 31
    return (mixed * 0xBF58476D1CE4E5B9 & ((1 << 64) - 1)) % count


class _Router:
    """The chosen router's state across one replay."""

    def __init__(self, config: RoutingSimConfig, runs: list[AccountingRun], tokens: TraceTokens) -> None:
        self.config = config
        self.runs = runs
        self.tokens = tokens
        self.names = [f"r{i}" for i in range(len(runs))]
        block_size = config.cache.block_size
        self.index = JointIndex(block_size, "xxh3_128")  # the simulator's managers hash unkeyed
        for name in self.names:
            self.index.add_replica(name)
        self.hash_id = hash_identity("xxh3_128")
        self.roots: dict[int, int] = {}
        self.turn = 0
        self.epoch = 0
        self.next_refresh = 0.0
        self.dirty = set(range(len(runs)))
        self.reasons: Counter[str] = Counter()
        self.last_depth = 0

    def refresh(self, now: float) -> None:
        """Take fresh summaries from the replicas that served since the last refresh, once a period."""
        if now < self.next_refresh:
            return
        self.epoch += 1
        block_size = self.config.cache.block_size
        for replica in sorted(self.dirty):
            summary = encode_summary(self.runs[replica].cache.joint_boundaries(), block_size, self.epoch, self.hash_id)
            self.index.update(self.names[replica], summary)
        self.dirty.clear()
        self.next_refresh = now + self.config.summary_period

    def choose(self, index: int, prompt: list[int], loads: list[float]) -> int:
        """The replica for request `index`."""
        router, count = self.config.router, len(self.runs)
        self.turn += 1
        if router == "round-robin" or count == 1:
            return (self.turn - 1) % count
        if router == "least-load":
            order = [(self.turn + i) % count for i in range(count)]
            return min(order, key=lambda r: loads[r])
        if router == "session":
            return _stable_slot(conversation_roots(self.tokens, index, self.roots), count)
        depths = self.index.depths(prompt, None)
        named_loads = dict(zip(self.names, loads))
        decision = choose_replica(depths, named_loads, len(prompt), self.config.router_config, self.turn)
        self.reasons[decision.reason] += 1
        self.last_depth = depths.get(decision.replica, 0)
        return self.names.index(decision.replica)


def simulate_routing(tokens: TraceTokens, shape: ModelShape, config: RoutingSimConfig, progress: bool = False,
                     check: bool = False, on_request: Callable[[int], None] | None = None) -> RoutingResult:
    """Replay `tokens` across `config.replicas` replicas behind `config.router`; `check` verifies
    every replica's pools at the end."""
    if config.router not in ROUTERS + (SINGLE,):
        raise ValueError(f"unknown router {config.router!r}; choose from {', '.join(ROUTERS)}")
    if config.replicas < 1 or config.summary_period < 0 or not 0 < config.utilization:
        raise ValueError("replicas must be >= 1, the summary period >= 0 and the utilization > 0")
    count = config.replicas
    runs = [AccountingRun(split_budgets(config.cache, count), shape) for _ in range(count)]
    router = _Router(config, runs, tokens)
    rate = service_rate(tokens, count, config.utilization)
    busy_until = [0.0] * count
    work = [0.0] * count
    recent, last = [0.0] * count, 0.0
    routes: list[int] = []
    start = time.perf_counter()
    prompt_tokens = hit_tokens = skipped = exact = 0
    total_flops = saved_flops = wait = route_seconds = 0.0
    origin = tokens.records[0].timestamp
    label = f"sim {config.router} x{count}"
    for index in tqdm(range(len(tokens.records)), desc=label, disable=not progress, leave=False, mininterval=1.0):
        record = tokens.records[index]
        now = (record.timestamp - origin) / 1000.0
        prompt, output = tokens.prompt(index), tokens.output(index)
        if not runs[0].fits(len(prompt) + len(output)):
            skipped += 1
            continue
        if on_request is not None:
            on_request(index)
        decay = 0.5 ** ((now - last) / config.load_half_life) if config.load_half_life else 0.0
        recent, last = [value * decay for value in recent], now
        loads = [max(0.0, until - now) * rate + value for until, value in zip(busy_until, recent)]
        if config.router == "joint":
            router.refresh(now)  # the replicas' side: not router time
        began = time.perf_counter()
        replica = router.choose(index, prompt, loads)
        route_seconds += time.perf_counter() - began
        hit = runs[replica].serve(str(index), prompt, output)
        router.dirty.add(replica)
        routes.append(replica)
        exact += hit == router.last_depth
        cost = len(prompt) - hit + len(output)
        begin = max(busy_until[replica], now)
        wait += begin - now
        busy_until[replica] = begin + cost / rate
        work[replica] += cost
        recent[replica] += cost
        prompt_tokens += len(prompt)
        hit_tokens += hit
        total_flops += shape.cost.prefill_flops(len(prompt))
        saved_flops += shape.cost.prefill_flops(hit)
    if check:
        for run in runs:
            run.scheduler.check_integrity()
    served = len(tokens.records) - skipped
    return RoutingResult(config, served, skipped, prompt_tokens, hit_tokens, total_flops, saved_flops, tuple(work),
                         wait / max(served, 1), tuple(sorted(router.reasons.items())),
                         exact / max(served, 1) if config.router == "joint" else 0.0, route_seconds,
                         time.perf_counter() - start, tuple(routes))

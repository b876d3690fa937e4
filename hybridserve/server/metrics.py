"""Prometheus metrics of one app, in its own registry: engine gauges and counters read from
`engine.stats()` at scrape time, and serving-path metrics (latencies, tokens, finish reasons) fed
as requests progress."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridserve.sampling_params import RequestOutput

PREFIX = "hybridserve"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (metric name, stats key, help)
_GAUGES = (
    ("num_requests_running", "num_running", "Requests in the running batch."),
    ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    ("kv_blocks_total", "kv_blocks_total", "KV cache blocks in the pool."),
    ("kv_blocks_used", "kv_blocks_used", "KV cache blocks held by running requests."),
    ("kv_blocks_cached", "kv_blocks_cached_free", "Free KV blocks still holding a cached prefix."),
    ("kv_blocks_free", "kv_blocks_free", "KV blocks free for allocation."),
    ("state_slots_total", "state_slots_total", "Gated DeltaNet state slots for running requests."),
    ("state_slots_free", "state_slots_free", "Free Gated DeltaNet state slots."),
    ("snapshot_slots_total", "snapshot_slots_total", "Capacity of the GDN state snapshot pool."),
    ("snapshots", "snapshot_slots_used", "GDN state snapshots held by the prefix cache."),
    ("snapshot_bytes", "snapshot_bytes", "Bytes held by GDN state snapshots."),
    ("bytes_per_snapshot", "bytes_per_snapshot", "Bytes of one GDN state snapshot."),
    ("kv_pool_bytes", "kv_pool_bytes", "Capacity of the KV pool in bytes."),
    ("kv_used_bytes", "kv_used_bytes", "Bytes of KV blocks held by running requests."),
    ("kv_cached_free_bytes", "kv_cached_free_bytes", "Bytes of free KV blocks still holding a cached prefix."),
    ("snapshot_pool_bytes", "snapshot_pool_bytes", "Capacity of the GDN snapshot pool in bytes."),
    ("weight_bytes", "weight_bytes", "Bytes of model weights held on the device."),
    ("heap_free_bytes", "heap_free_bytes",
     "Freed memory the engine process's allocator keeps for reuse (CPU, glibc: activations are kept on purpose)."),
    ("snapshots_reserved", "snapshots_reserved", "Snapshot slots reserved by the running step."),
    ("snapshots_pinned", "snapshots_pinned", "Snapshot pins held by the running step."),
)
_COUNTERS = (
    ("prefix_cache_queries", "prefix_cache_queries", "Requests that looked up the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits", "Requests that reused a cached prefix."),
    ("prefix_cache_query_tokens", "prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hit_tokens", "prefix_cache_hit_tokens", "Prompt tokens restored from the prefix cache."),
    ("prefix_cache_kv_only_misses", "kv_only_misses", "Lookups with cached KV blocks but no usable snapshot."),
    ("prefix_cache_snapshot_only_misses", "snapshot_only_misses", "Lookups with a snapshot but missing KV blocks."),
    ("snapshots_published", "snapshots_published", "GDN state snapshots published to the cache."),
    ("snapshot_evictions", "snapshots_evicted", "GDN state snapshots evicted."),
    ("snapshots_skipped", "snapshots_skipped", "Snapshot captures skipped (pool full or disabled)."),
)

# Per lower cache tier (engine stats keys `tier_<tier>_<field>`), one family labelled by tier.
_TIER_GAUGES = {"budget_bytes": "Byte budget of the cache tier.", "used_bytes": "Bytes held in the cache tier.",
                "entries": "Joint entries (state + prefix KV) in the cache tier.",
                "kv_objects": "KV block objects in the cache tier."}
_TIER_COUNTERS = {
    "hits": "Lookups served from the cache tier.", "hit_tokens": "Prompt tokens served from the cache tier.",
    "promotions": "Promotions from the cache tier to the device.", "promoted_bytes": "Bytes promoted from the tier.",
    "promoted_objects": "Objects promoted from the tier.", "demotions": "Demotions into the cache tier.",
    "demoted_bytes": "Bytes demoted into the tier.", "demoted_objects": "Objects demoted into the tier.",
    "evictions": "Joint entries evicted from the tier.",
    "dropped": "Demotions the tier refused (too large, no room, worth less than all it holds, no source).",
    "failed": "Transfers that failed (corrupt, truncated or missing objects: counted misses).",
    "lookups": "Discovery lookups in the shared (remote) tier's store.",
    "discovered": "Discovery lookups that found an entry another replica wrote.",
}

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class EngineStatsCollector(Collector):
    """Exposes the latest `engine.stats()` dict; keys the engine lacks are skipped."""

    def __init__(self) -> None:
        self.stats: dict[str, float] = {}

    def collect(self) -> Iterator[Metric]:
        """Yield one gauge or counter family per known stats key."""
        stats = self.stats
        for families, kind in ((_GAUGES, GaugeMetricFamily), (_COUNTERS, CounterMetricFamily)):
            yield from (kind(f"{PREFIX}_{name}", doc, value=float(stats[key])) for name, key, doc in families
                        if key in stats)
        yield from _tier_families(stats)


def _tier_families(stats: dict[str, float]) -> Iterator[Metric]:
    """`hybridserve_tier_<field>{tier=...}` from the engine's `tier_<tier>_<field>` keys."""
    by_field: dict[str, list[tuple[str, float]]] = {}
    for key, value in stats.items():
        tier, _, field = key.removeprefix("tier_").partition("_")
        if key.startswith("tier_") and (field in _TIER_GAUGES or field in _TIER_COUNTERS):
            by_field.setdefault(field, []).append((tier, float(value)))
    for field, samples in by_field.items():
        family: GaugeMetricFamily | CounterMetricFamily
        if field in _TIER_GAUGES:
            family = GaugeMetricFamily(f"{PREFIX}_tier_{field}", _TIER_GAUGES[field], labels=["tier"])
        else:
            family = CounterMetricFamily(f"{PREFIX}_tier_{field}", _TIER_COUNTERS[field], labels=["tier"])
        for tier, value in samples:
            family.add_metric([tier], value)
        yield family


class RequestTracker:
    """Feeds one engine request's progress into the serving-path metrics."""

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self._metrics = metrics
        self._arrival = arrival
        self._last_time: float | None = None
        self._num_tokens = 0
        self._done = False

    def observe(self, output: RequestOutput, delta: bool = False) -> None:
        """Record TTFT / inter-token latency for tokens new since the last call (over all of the
        request's completions); `delta` when `output` holds only what is new (a DELTA stream)."""
        num_tokens = sum(len(o.token_ids) for o in output.outputs)
        if delta:
            num_tokens += self._num_tokens
        new = num_tokens - self._num_tokens
        if new > 0:
            now = time.monotonic()
            if self._last_time is None:
                # Several tokens at once (a final-only request): the engine's first-token time,
                # on the same monotonic clock, dates the first, and the rest share the remaining time.
                first = output.metrics.get("first_token_time") if new > 1 else None
                self._metrics.ttft.observe((now if first is None else first) - self._arrival)
                self._last_time = now if first is None else first
                new -= 1
            if new > 0 and self._last_time is not None:
                gap = (now - self._last_time) / new
                for _ in range(new):
                    self._metrics.itl.observe(gap)
            self._last_time = now
            self._num_tokens = num_tokens
        if output.finished:
            self.finish(output, delta)

    def finish(self, output: RequestOutput, delta: bool = False) -> None:
        """Count tokens and the finish reason once (`delta`: the tokens seen by `observe`)."""
        if self._done:
            return
        self._done = True
        self._metrics.prompt_tokens.inc(len(output.prompt_token_ids))
        generated = self._num_tokens if delta else sum(len(o.token_ids) for o in output.outputs)
        self._metrics.generation_tokens.inc(generated)
        self._metrics.e2e.observe(time.monotonic() - self._arrival)
        for completion in output.outputs:
            self._metrics.success.labels(finished_reason=completion.finish_reason or "unknown").inc()


class ServerMetrics:
    """All collectors of one app, registered in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.engine_stats = EngineStatsCollector()
        self.registry.register(self.engine_stats)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Time between output tokens.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens processed.", registry=self.registry)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated.", registry=self.registry)
        self.success = Counter(f"{PREFIX}_request_success", "Finished requests by finish reason.",
                               ["finished_reason"], registry=self.registry)

    def tracker(self, arrival: float | None = None) -> RequestTracker:
        """A tracker for one engine request that arrived at `arrival` (monotonic seconds)."""
        return RequestTracker(self, time.monotonic() if arrival is None else arrival)

    def render(self, stats: dict[str, float]) -> bytes:
        """Prometheus text exposition, with the engine part taken from `stats`."""
        self.engine_stats.stats = dict(stats)
        return generate_latest(self.registry)

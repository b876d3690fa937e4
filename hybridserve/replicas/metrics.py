"""Per-replica and routing metrics of the ingress `/metrics`: each replica's prefix-cache traffic and
load as last published (label `replica`), its hit rate, requests in flight to it, the router's
decisions by reason, and per-replica store traffic (`tier_remote_*` engine stats) when a shared store
is on. The engine families of the app itself carry the sums over replicas."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridserve.replicas.registry import RouterSnapshot, active_routers
from hybridserve.server.metrics import PREFIX

# (metric name, engine stats key, help, is a counter)
_REPLICA_FAMILIES = (
    ("replica_prefix_cache_queries", "prefix_cache_queries", "Requests that looked up the replica's prefix cache.",
     True),
    ("replica_prefix_cache_hits", "prefix_cache_hits", "Requests that reused a cached prefix on the replica.", True),
    ("replica_prefix_cache_query_tokens", "prefix_cache_query_tokens", "Prompt tokens looked up on the replica.",
     True),
    ("replica_prefix_cache_hit_tokens", "prefix_cache_hit_tokens", "Prompt tokens restored on the replica.", True),
    ("replica_num_requests_running", "num_running", "Requests in the replica's running batch.", False),
    ("replica_num_requests_waiting", "num_waiting", "Requests waiting on the replica.", False),
)
STORE_TIER_PREFIX = "tier_remote_"


class ReplicaMetricsCollector(Collector):
    """Families built at scrape time from the routers' snapshots (`JointCacheRouter.snapshot`)."""

    def __init__(self, snapshots: Callable[[], list[RouterSnapshot]] | None = None) -> None:
        self._snapshots = snapshots or (lambda: [router.snapshot() for router in active_routers()])

    def collect(self) -> Iterator[Metric]:
        """Yield the replica, hit-rate, in-flight, store and decision families."""
        snapshots = self._snapshots()
        replicas: dict[str, dict[str, float]] = {}
        in_flight: dict[str, int] = {}
        decisions: dict[str, int] = {}
        for snap in snapshots:
            replicas.update(snap.replica_stats)
            for name, count in snap.in_flight.items():
                in_flight[name] = in_flight.get(name, 0) + count
            for reason, count in snap.decisions.items():
                decisions[reason] = decisions.get(reason, 0) + count
        for name, key, doc, counter in _REPLICA_FAMILIES:
            yield _family(name, doc, {r: stats[key] for r, stats in replicas.items() if key in stats}, counter)
        yield _family("replica_prefix_cache_hit_rate",
                      "Share of the replica's looked-up prompt tokens restored from its cache.",
                      {r: float(stats.get("prefix_cache_hit_tokens", 0))
                       / max(float(stats.get("prefix_cache_query_tokens", 0)), 1.0) for r, stats in replicas.items()})
        yield _family("replica_requests_in_flight", "Requests the router sent to the replica and not finished.",
                      {r: in_flight.get(r, 0) for r in replicas})
        store_fields = sorted({key[len(STORE_TIER_PREFIX):] for stats in replicas.values() for key in stats
                               if key.startswith(STORE_TIER_PREFIX)})
        for field in store_fields:
            key = STORE_TIER_PREFIX + field
            yield _family(f"replica_store_{field}", f"The replica's shared-store tier stat {field!r}.",
                          {r: stats[key] for r, stats in replicas.items() if isinstance(stats.get(key), (int, float))})
        yield _family("router_decisions", "Routing decisions by reason.", decisions, counter=True, label="reason")


def _family(name: str, doc: str, values: Mapping[str, float], counter: bool = False,
            label: str = "replica") -> Metric:
    """One family labelled by `label`: a sample per key of `values`, in key order."""
    family: GaugeMetricFamily | CounterMetricFamily = (
        CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=[label]) if counter
        else GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=[label]))
    for key, value in sorted(values.items()):
        family.add_metric([key], float(value))
    return family

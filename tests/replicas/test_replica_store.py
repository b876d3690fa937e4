"""Failover with the shared store: a conversation's replica is killed after its first turn, and the
next turn, on a replica that never served it, restores from the Redis store every replica writes
through to. Slow: a cluster of its own and a redis-server (skipped when none is installed)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="the replica tests need `pip install hybridserve[ray]`")

from tests.replicas.cluster import APP, NUM_REPLICAS, chat, metric, replica_cluster, user_text, wait_for  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _replicas(url: str) -> set[str]:
    """Replica names the router shows in /metrics."""
    return {labels.split('"')[1] for labels in metric(url, "hybridserve_replica_requests_in_flight")}


def test_a_turn_after_its_replica_was_killed_restores_from_the_shared_store(tmp_path: Path) -> None:
    import ray

    from tests.cache.test_remote_store import REDIS_SERVER, RedisServer

    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (.ci/run installs it with apt-get)")
    store = RedisServer(tmp_path)
    try:
        with replica_cluster(remote_cache_url=store.url) as url:
            wait_for(lambda: len(_replicas(url)) == NUM_REPLICAS, timeout=60, what="every replica reporting")
            messages = [{"role": "user", "content": user_text(800)}]
            reply = chat(url, messages)["choices"][0]["message"]["content"]
            queries = "hybridserve_replica_prefix_cache_queries_total"
            wait_for(lambda: sum(metric(url, queries).values()) == 1, what="the turn in the replicas' stats")
            holder = next(labels.split('"')[1] for labels, count in metric(url, queries).items() if count == 1)
            ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#engine#{holder}", namespace="serve"), no_restart=True)
            wait_for(lambda: holder not in _replicas(url), what="the router dropping the killed replica")
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": user_text(801)}]
            cached = chat(url, messages)["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached > 0  # restored on a replica that never served this conversation
            hits = "hybridserve_replica_store_hits"
            wait_for(lambda: sum(metric(url, hits).values()) >= 1, what="a store hit in the metrics")
    finally:
        store.stop()

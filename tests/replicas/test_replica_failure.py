"""Killing an engine replica mid-stream: its stream ends with a clear error, the router stops
choosing it within seconds (requests keep succeeding on the other replica), and Ray Serve brings a
replacement up that the router then sees. Slow: a cluster of its own, and a replica restart."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("ray.serve", reason="the replica tests need `pip install hybridserve[ray]`")

from tests.replicas.cluster import (  # noqa: E402
    APP,
    KEYS,
    MODEL,
    NUM_REPLICAS,
    metric,
    replica_cluster,
    user_text,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}
IN_FLIGHT = "hybridserve_replica_requests_in_flight"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with replica_cluster() as url:
        yield url


def _replicas(url: str) -> set[str]:
    """Replica names the router shows in /metrics."""
    return {labels.split('"')[1] for labels in metric(url, IN_FLIGHT)}


def _complete(url: str, seed: int) -> int:
    body = {"model": MODEL, "prompt": user_text(seed, 60), "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60).status_code


def test_killed_replica_ends_its_stream_and_is_replaced(endpoint: str) -> None:
    import ray

    wait_for(lambda: len(_replicas(endpoint)) == NUM_REPLICAS, timeout=60, what="every replica reporting")
    before = _replicas(endpoint)
    body = {"model": MODEL, "prompt": user_text(700, 60), "max_tokens": 4000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", f"{endpoint}/v1/completions", json=body, headers=AUTH, timeout=120) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        while len(events) < 3:  # the stream is running: find the replica serving it and kill it
            line = next(lines)
            if line.startswith("data: "):
                events.append(line[6:])
        busy = [labels.split('"')[1] for labels, count in metric(endpoint, IN_FLIGHT).items() if count > 0]
        assert len(busy) == 1, busy
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#engine#{busy[0]}", namespace="serve"), no_restart=True)
        killed_at = time.monotonic()
        events += [line[6:] for line in lines if line.startswith("data: ")]
    assert time.monotonic() - killed_at < 30
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_unavailable" and "replica" in error["message"], error
    assert not any('"finish_reason":"length"' in event for event in events)
    # the router stops choosing it within seconds: every request succeeds from then on
    wait_for(lambda: all(_complete(endpoint, 710 + i) == 200 for i in range(3)), timeout=10,
             what="requests succeeding after the kill")
    assert busy[0] not in _replicas(endpoint)
    assert all(_complete(endpoint, 720 + i) == 200 for i in range(4))
    # Ray Serve replaces it, and the router routes to the new replica
    wait_for(lambda: len(_replicas(endpoint)) == NUM_REPLICAS, timeout=240, what="a replacement replica")
    replacement = _replicas(endpoint) - before
    assert len(replacement) == 1
    assert httpx.get(f"{endpoint}/health", timeout=30).status_code == 200


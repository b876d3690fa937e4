"""Two engine replicas of the built-in model on a local Ray Serve cluster, behind one endpoint,
against one engine with the same configuration: identical greedy outputs, conversations kept on the
replica holding their state (the same cached tokens as one engine), tenants never sharing a hit,
routing and per-replica metrics, and the start-up errors of `serve --replicas`. CPU, float32."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("ray.serve", reason="the replica tests need `pip install hybridserve[ray]`")

from hybridserve.server.cli import main as serve_main  # noqa: E402
from tests.replicas.cluster import (  # noqa: E402
    KEYS,
    MODEL,
    NUM_REPLICAS,
    chat,
    converse,
    free_port,
    metric,
    replica_cluster,
    single_engine,
    user_text,
    wait_for,
)

pytestmark = pytest.mark.timeout(600)
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}


@pytest.fixture(scope="module")
def endpoints() -> Iterator[tuple[str, str]]:
    """(the replicas' URL, the single engine's URL), for the whole module."""
    with replica_cluster(dev_mode=True) as replicas, single_engine() as single:
        yield replicas, single


def _interleaved(url: str) -> tuple[list[tuple[str, int]], list[dict[str, str]]]:
    """Two conversations of three turns, their turns alternating: (reply, cached tokens) per request,
    and the first conversation's messages."""
    first, second = [], []
    messages_a: list[dict[str, str]] = []
    messages_b: list[dict[str, str]] = []
    for turn in range(3):
        for messages, seed, out in ((messages_a, 100 + turn, first), (messages_b, 200 + turn, second)):
            messages.append({"role": "user", "content": user_text(seed)})
            body = chat(url, messages)
            reply = body["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": reply})
            out.append((reply, int(body["usage"]["prompt_tokens_details"]["cached_tokens"])))
    return first + second, messages_a


def _completions(url: str, stream: bool) -> list[str]:
    body = {"model": MODEL, "prompt": [user_text(300), user_text(301, 40)], "max_tokens": 10, "temperature": 0,
            "stream": stream}
    if not stream:
        response = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)
        assert response.status_code == 200, response.text
        return [choice["text"] for choice in sorted(response.json()["choices"], key=lambda c: c["index"])]
    texts = ["", ""]
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in httpx.Response(200, content=line[6:]).json()["choices"]:
                    texts[choice["index"]] += choice["text"]
    return texts


def test_two_replicas_serve_like_one_engine(endpoints: tuple[str, str]) -> None:
    replicas, single = endpoints
    # later turns land on the replica holding the conversation: the same cached tokens as one engine
    expected, _ = _interleaved(single)
    results, messages = _interleaved(replicas)
    assert results == expected
    later_turns = [cached for index, (_, cached) in enumerate(expected) if index % 3]
    assert all(cached > 0 for cached in later_turns), expected
    # greedy outputs identical to one engine, streamed or not
    assert _completions(replicas, stream=False) == _completions(single, stream=False)
    assert _completions(replicas, stream=True) == _completions(single, stream=True)
    # the router counted its decisions; both replicas served (the two conversations were spread)
    decisions = metric(replicas, "hybridserve_router_decisions_total")
    assert sum(count for reason, count in decisions.items() if "no_hit" not in reason) >= len(later_turns)
    wait_for(lambda: len(metric(replicas, "hybridserve_replica_prefix_cache_queries_total")) == NUM_REPLICAS,
             what="stats of every replica")
    wait_for(lambda: all(v > 0 for v in metric(replicas, "hybridserve_replica_prefix_cache_queries_total").values()),
             what="queries on every replica")
    rates = metric(replicas, "hybridserve_replica_prefix_cache_hit_rate")
    assert len(rates) == NUM_REPLICAS and all(0 <= rate <= 1 for rate in rates.values())
    # once the replicas' summaries are in, a conversation's next turn is routed as a joint hit
    wait_for(lambda: sum(metric(replicas, "hybridserve_replica_prefix_cache_queries_total").values()) == 10,
             what="stats after the last request")
    joint_hits = decisions.get('{reason="joint_hit"}', 0)
    body = chat(replicas, [*messages, {"role": "user", "content": user_text(103)}])
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert metric(replicas, "hybridserve_router_decisions_total")['{reason="joint_hit"}'] == joint_hits + 1


def test_start_up_errors_are_one_line(endpoints: tuple[str, str], caplog: pytest.LogCaptureFixture,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.ERROR, logger="hybridserve.server")
    # more replicas than the (2-CPU) cluster holds
    argv = ["--replicas", "3", "--device", "cpu", "--port", str(free_port())]
    assert serve_main(argv) == 2
    errors = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert errors == ["cannot start: 3 replicas need 3 CPUs (1 each); the Ray cluster has 2"]
    caplog.clear()
    # no Ray installed
    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    assert serve_main(["--replicas", "2", "--device", "cpu", "--port", str(free_port())]) == 2
    errors = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert len(errors) == 1 and "pip install hybridserve[ray]" in errors[0], errors


@pytest.mark.slow
def test_tenants_never_share_a_hit(endpoints: tuple[str, str]) -> None:
    replicas, _ = endpoints
    seeds = [400, 401]
    first = converse(replicas, seeds, KEYS[0])
    assert first[1][1] > 0
    # the same conversation from the other tenant: nothing cached from the first tenant's turns
    second = converse(replicas, seeds, KEYS[1])
    assert second[0][1] == 0
    assert [reply for reply, _ in second] == [reply for reply, _ in first]
    # a client cache_salt is combined with the tenant, never shared across tenants
    messages = [{"role": "user", "content": user_text(402)}]
    for key in KEYS:
        body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, "cache_salt": "shared"}
        response = httpx.post(f"{replicas}/v1/chat/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.slow
def test_many_conversations_keep_their_hits(endpoints: tuple[str, str]) -> None:
    replicas, single = endpoints
    conversations = [[500 + 10 * c + turn for turn in range(3)] for c in range(4)]
    expected = [converse(single, seeds) for seeds in conversations]
    assert [converse(replicas, seeds) for seeds in conversations] == expected
    health = httpx.get(f"{replicas}/health", timeout=30)
    assert health.status_code == 200


def test_a_reset_reaches_every_replica(endpoints: tuple[str, str]) -> None:
    """`POST /reset_prefix_cache` (dev mode) resets each replica, reached by name: conversations that
    hit on both replicas before compute their prompts whole after it."""
    replicas, _ = endpoints
    conversations = [[{"role": "user", "content": user_text(seed)}] for seed in (500, 600, 700, 800)]
    for messages in conversations:
        chat(replicas, messages)
    assert all(chat(replicas, messages)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
               for messages in conversations)
    response = httpx.post(f"{replicas}/reset_prefix_cache", headers=AUTH, timeout=120)
    assert response.status_code == 200 and response.json() == {"reset": True}, response.text
    assert [chat(replicas, messages)["usage"]["prompt_tokens_details"]["cached_tokens"]
            for messages in conversations] == [0] * len(conversations)

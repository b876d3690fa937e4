"""A local Ray cluster serving 2 replicas of the built-in model behind one ingress, a single-engine
server to compare it with, and the requests the replica tests send to both."""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from hybridserve.engine.async_engine import AsyncLLMEngine
from hybridserve.engine.engine import LLMEngine
from hybridserve.models.builtin import builtin_tokenizer
from hybridserve.server.app import build_app
from tests.helpers.live_server import ServerThread, random_ids, tiny_config

MODEL = "tiny"
KEYS = ("key-of-tenant-a", "key-of-tenant-b")
NUM_REPLICAS = 2
APP = "hybridserve-test"


def replica_config(remote_cache_url: str | None = None) -> Any:
    """The tiny engine each replica runs (one thread each: two replicas share a 2-core machine), with
    the shared store at `remote_cache_url` when given."""
    config = dataclasses.replace(tiny_config(), num_threads=1)
    if remote_cache_url is None:
        return config
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache, remote_cache_url=remote_cache_url))


def free_port() -> int:
    """A free loopback port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def replica_cluster(num_cpus: int = NUM_REPLICAS, remote_cache_url: str | None = None,
                    **options: Any) -> Iterator[str]:
    """A local Ray instance serving `NUM_REPLICAS` replicas (sharing the store at `remote_cache_url`
    when given); yields the endpoint's URL."""
    import ray
    from ray import serve

    from hybridserve.replicas import build_app as build_replicas

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report from a test cluster
    ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_replicas(replica_config(remote_cache_url), num_replicas=NUM_REPLICAS, model_name=MODEL,
                             api_keys=list(KEYS), stats_period_s=0.5, **options)
        serve.run(app, name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@contextmanager
def single_engine() -> Iterator[str]:
    """One engine with the replicas' configuration behind the same app; yields its URL."""
    engine = AsyncLLMEngine(LLMEngine(replica_config()))
    try:
        with ServerThread(build_app(engine, model_name=MODEL, api_keys=list(KEYS))) as server:
            yield server.url
    finally:
        engine.shutdown()


def user_text(seed: int, num_tokens: int = 320) -> str:
    """Text of about `num_tokens` built-in tokens, different for every seed."""
    return str(builtin_tokenizer().decode(random_ids(seed, num_tokens)))


def chat(url: str, messages: list[dict[str, str]], key: str = KEYS[0], max_tokens: int = 12) -> dict[str, Any]:
    """A greedy chat completion's JSON body."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return dict(response.json())


def converse(url: str, seeds: list[int], key: str = KEYS[0]) -> list[tuple[str, int]]:
    """A conversation of one user turn per seed: (reply, cached prompt tokens) per turn."""
    messages: list[dict[str, str]] = []
    turns = []
    for seed in seeds:
        messages.append({"role": "user", "content": user_text(seed)})
        body = chat(url, messages, key)
        reply = body["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": reply})
        turns.append((reply, int(body["usage"]["prompt_tokens_details"]["cached_tokens"])))
    return turns


def metric(url: str, name: str, key: str = KEYS[0]) -> dict[str, float]:
    """Samples of one metric family from `/metrics`, by their label text ("" when unlabelled)."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30).text
    samples = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, value = line.rsplit(" ", 1)
            samples[head[len(name):]] = float(value)
    return samples


def wait_for(predicate: Any, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll `predicate` until true (`timeout` only bounds a hang)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout:g} s"
        time.sleep(0.2)

"""A live server for end-to-end tests: uvicorn on a free loopback port in a daemon thread, the
small engine configuration the server tests run on, and probes of a served engine's state."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from hybridserve.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridserve.engine.async_engine import AsyncLLMEngine
from hybridserve.server.cli import bind_socket, serve_uvicorn
from tests.helpers.targets import CPU

VOCAB = 4096  # the built-in model's vocabulary size


def tiny_config(**scheduler: Any) -> EngineConfig:
    """The small engine all server tests run on."""
    sched = {"max_num_seqs": 8, "max_num_batched_tokens": 1024, **scheduler}
    return EngineConfig(model=None, **CPU.engine_kwargs(),
                        cache=CacheConfig(kv_cache_mib=32, prefix_cache_mib=64, snapshot_interval=256, block_size=16),
                        scheduler=SchedulerConfig(**sched))


class ServerThread:
    """A uvicorn server for `app` on a free 127.0.0.1 port, in a daemon thread."""

    def __init__(self, app: Any, engine: Any = None, root_path: str = "") -> None:
        """`engine`: the app's engine, served as `hybridserve serve` does (an engine core client
        then reads its outputs on the server's loop); `root_path`: uvicorn's `--root-path`."""
        self._sock = bind_socket("127.0.0.1", 0)  # the server's own: TCP_NODELAY on
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2,
                                                    root_path=root_path))
        self._thread = threading.Thread(target=serve_uvicorn, args=(self.server, [self._sock], engine), daemon=True)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self._sock.close()


def engine_stats(engine: AsyncLLMEngine) -> dict[str, float]:
    """Engine stats, read on the engine thread from this (test) thread."""
    return asyncio.run(engine.stats())


def wait_until(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    """Poll `predicate` until it holds; `timeout` only bounds the wait so that a hang fails."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def is_idle(engine: AsyncLLMEngine) -> bool:
    """No request holds anything: the pool counts are back to their idle values."""
    stats = engine_stats(engine)
    return (stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_blocks_used"] == 0
            and stats["state_slots_free"] == stats["state_slots_total"])


def random_ids(seed: int, n: int) -> list[int]:
    """`n` deterministic prompt token ids of the built-in vocabulary, drawn from [300, VOCAB)."""
    rng = random.Random(seed)
    return [rng.randrange(300, VOCAB) for _ in range(n)]

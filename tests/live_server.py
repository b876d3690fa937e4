"""A live server for end-to-end tests: uvicorn on a free loopback port in a daemon thread, and
the small engine configuration the server tests run on."""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from hybridserve.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridserve.server.cli import bind_socket, serve_uvicorn
from tests.targets import CPU


def tiny_config(**scheduler: Any) -> EngineConfig:
    """The small engine all server tests run on."""
    sched = {"max_num_seqs": 8, "max_num_batched_tokens": 1024, **scheduler}
    return EngineConfig(model=None, **CPU.engine_kwargs(),
                        cache=CacheConfig(kv_cache_mib=32, prefix_cache_mib=64, snapshot_interval=256, block_size=16),
                        scheduler=SchedulerConfig(**sched))


class ServerThread:
    """A uvicorn server for `app` on a free 127.0.0.1 port, in a daemon thread."""

    def __init__(self, app: Any, engine: Any = None) -> None:
        """`engine`: the app's engine, served as `hybridserve serve` does (an engine core client
        then reads its outputs on the server's loop)."""
        self._sock = bind_socket("127.0.0.1", 0)  # the server's own: TCP_NODELAY on
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=serve_uvicorn, args=(self.server, [self._sock], engine), daemon=True)

    def __enter__(self) -> "ServerThread":
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



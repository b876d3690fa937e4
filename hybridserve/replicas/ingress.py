"""`Ingress`: the Ray Serve deployment that serves the unchanged OpenAI-compatible app of
`hybridserve.server` (tokenization, validation, auth, SSE) over a `ReplicaEngineClient`, with the
per-replica and routing families added to its `/metrics`."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from ray import serve

from hybridserve.replicas.client import ReplicaEngineClient
from hybridserve.replicas.metrics import ReplicaMetricsCollector
from hybridserve.server.app import build_app


@serve.ingress()
class Ingress:
    """Holds the replica deployment's handle (its router runs in this process) and builds the app."""

    async def __init__(self, replicas: Any, app_options: dict[str, Any]) -> None:
        self.client = await ReplicaEngineClient.connect(replicas)
        self.app_options = app_options

    def __serve_build_asgi_app__(self) -> FastAPI:
        """The HTTP app (Serve calls this once, after the constructor)."""
        app = build_app(self.client, **self.app_options)
        app.state.metrics.registry.register(ReplicaMetricsCollector())
        return app

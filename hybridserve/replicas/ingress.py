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

    def __init__(self, replicas: Any, app_options: dict[str, Any]) -> None:
        self.replicas = replicas
        self.app_options = app_options

    async def __serve_build_asgi_app__(self) -> FastAPI:
        """The HTTP app (Serve calls this once, after the constructor), over a client that one
        replica described."""
        client = await ReplicaEngineClient.connect(self.replicas)
        app = build_app(client, **self.app_options)
        app.state.metrics.registry.register(ReplicaMetricsCollector())
        return app

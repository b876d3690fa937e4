"""The OpenAI-compatible HTTP app (docs/serving.md's routes) around any `EngineClient`: handlers by
role, the error envelope, bearer-key auth on every route but the probes, request limits, request
ids and the access log."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from hybridserve import envs
from hybridserve.engine.protocol import EngineClient
from hybridserve.server.admin import AdminServing, install_admin_routes
from hybridserve.server.auth import PUBLIC_PATHS, ApiKeyring, TenantAuthMiddleware
from hybridserve.server.chat_completions import ChatServing, install_chat_routes
from hybridserve.server.completions import CompletionServing, install_completion_routes
from hybridserve.server.docs_ui import install_docs_routes, swagger_ui_dir
from hybridserve.server.errors import install_error_handlers
from hybridserve.server.limits import DEFAULT_LIMITS, ServerLimits
from hybridserve.server.middleware import DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware, RequestIdMiddleware
from hybridserve.server.serving import ServingContext

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_BODY_BYTES", "build_app"]


def _preload_stream_backend() -> None:
    """Import anyio's asyncio backend now: a streamed response runs in an anyio task group, and
    the first one imports it lazily, which would land in the first request's TTFT."""
    try:
        importlib.import_module("anyio._backends._asyncio")
    except ImportError:  # a future anyio may move it; the lazy import still works then
        logger.debug("anyio asyncio backend not preloaded")


def _lifespan(engine: EngineClient, shutdown_engine: bool) -> Callable[[FastAPI], Any]:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            if shutdown_engine:
                await asyncio.to_thread(engine.shutdown)

    return lifespan


def build_app(engine: EngineClient, *, model_name: str | Sequence[str], api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, shutdown_engine: bool = False,
              reasoning_parser: str | None = None, api_keys: Sequence[str] = (), stream_interval: int = 1,
              limits: ServerLimits = DEFAULT_LIMITS, dev_mode: bool | None = None) -> FastAPI:
    """The HTTP app around an engine client, started with the app (`shutdown_engine`: stopped with it); the
    options are `hybridserve serve`'s flags of the same names, `limits` bound each request (docs/serving.md),
    `dev_mode` serves the operator endpoints (None: as HYBRIDSERVE_SERVER_DEV_MODE says)."""
    limits = dataclasses.replace(limits, max_body_bytes=max_body_bytes)  # checks the value too
    context = ServingContext.create(engine, model_name, reasoning_parser, stream_interval, limits)
    _preload_stream_backend()
    app = FastAPI(title="hybridserve", lifespan=_lifespan(engine, shutdown_engine),
                  openapi_url="/openapi.json", docs_url=None, redoc_url=None)
    app.state.metrics = context.metrics  # more collectors may join its registry (hybridserve.replicas)
    install_error_handlers(app)
    install_completion_routes(app, CompletionServing(context))
    install_chat_routes(app, ChatServing(context))
    install_admin_routes(app, AdminServing(context), envs.server_dev_mode() if dev_mode is None else dev_mode)
    install_docs_routes(app, swagger_ui_dir())
    # Added innermost first: request ids (outermost) see every answer, auth refuses before a body is read.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=limits.max_body_bytes)
    keyring = ApiKeyring([*api_keys, *([api_key] if api_key else [])])
    if len(keyring):
        public = [route for route in app.routes if getattr(route, "path", None) in PUBLIC_PATHS]
        app.add_middleware(TenantAuthMiddleware, keyring=keyring, public_routes=public)
    app.add_middleware(RequestIdMiddleware)
    return app

"""OpenAI-compatible HTTP server: `build_app` (FastAPI factory) and the `serve` CLI pieces."""

from hybridserve.server.app import DEFAULT_MAX_BODY_BYTES, build_app

__all__ = ["DEFAULT_MAX_BODY_BYTES", "build_app"]

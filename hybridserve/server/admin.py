"""The admin endpoints: models, tokenize, detokenize, version, the probes (`/health`: 503 naming
the reason once the engine stopped; `/ready`: 503 until the engine serves), Prometheus metrics, and
in dev mode the operator endpoints (`/reset_prefix_cache`)."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import Response

import hybridserve
from hybridserve.errors import EngineDeadError
from hybridserve.server.errors import APIError
from hybridserve.server.limits import check_token_ids, check_tools
from hybridserve.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from hybridserve.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from hybridserve.server.serving import OpenAIServing, json_response


class AdminServing(OpenAIServing):
    """The handlers of the model list, tokenizer, health and metrics endpoints."""

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        """`POST /tokenize`: token ids of a prompt, or of chat messages rendered by the template."""
        self._check_model(body.model)
        if body.messages is not None:
            tools = [tool.template_dict() for tool in body.tools] if body.tools else None
            check_tools(tools, self.limits)
            text = self._render_chat(body.messages, tools, body.chat_template_kwargs, body.add_generation_prompt)
        else:
            text = body.prompt or ""
        ids = list(await asyncio.to_thread(self.tokenizer.encode, text)) if text else []
        strs = [self._token_text(t) for t in ids] if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """`POST /detokenize`: the text of token ids."""
        self._check_model(body.model)
        check_token_ids(body.tokens, self.vocab_size, "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(body.tokens))

    def model_card(self, name: str) -> ModelCard:
        """`GET /v1/models/{name}`."""
        self._check_model(name)
        return ModelCard(id=name, max_model_len=self.engine.max_model_len)


def install_admin_routes(app: FastAPI, serving: AdminServing, dev_mode: bool = False) -> None:
    """Route the admin endpoints to `serving` (with `dev_mode`, the operator endpoints too)."""

    @app.get("/v1/models")
    async def list_models() -> Response:
        return json_response(ModelList(data=[serving.model_card(name) for name in serving.model_names]))

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        return json_response(serving.model_card(model_id))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return json_response(await serving.tokenize(body))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return json_response(await serving.detokenize(body))

    @app.get("/version")
    async def version() -> Response:
        return json_response(VersionResponse(version=hybridserve.__version__))

    def require_running() -> None:
        """503 unless the engine serves and its core beats (`CoreClient.health_problem`)."""
        problem = serving.engine.health_problem
        if problem is not None:
            message = problem if problem.startswith("engine is not running") else f"engine is not running: {problem}"
            raise APIError(503, message, code="engine_unavailable")

    @app.get("/health")
    async def health() -> Response:
        require_running()
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: 200 once the engine serves requests, 503 before it started and after it stopped."""
        require_running()
        return Response(b'{"status":"ready"}', media_type="application/json")

    if dev_mode:
        install_operator_routes(app, serving)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            stats = await serving.engine.stats()
        except EngineDeadError:  # the metrics stay readable: the serving-path ones without engine stats
            stats = {}
        return Response(serving.metrics.render(stats), media_type=METRICS_CONTENT_TYPE)



def install_operator_routes(app: FastAPI, serving: AdminServing) -> None:
    """Route the operator endpoints (dev mode only, as in vLLM: HYBRIDSERVE_SERVER_DEV_MODE):
    `POST /reset_prefix_cache?reset_running_requests=BOOL&reset_tiers=BOOL` answers `{"reset": true}`,
    or 409 while requests run and `reset_running_requests` is not given."""

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False, reset_tiers: bool = False) -> Response:
        if not await serving.engine.reset_prefix_cache(reset_running_requests, reset_tiers):
            raise APIError(409, "requests are running: the prefix cache was not reset (behind replicas: not on "
                           "every replica); retry when idle, or pass reset_running_requests=true to preempt them "
                           "(they recompute)", code="requests_running")
        return Response(b'{"reset":true}', media_type="application/json")

"""`EngineReplica`: the body of the Ray Serve deployment that runs one engine (its own tensor-parallel
group) per replica. It streams each request's outputs back to the ingress, answers Serve's health
check from the engine's, and publishes the engine's joint-boundary summary and load as its
routing stats (`record_routing_stats`, read by `JointCacheRouter`)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from hybridserve.config import EngineConfig
from hybridserve.engine.protocol import EngineClient
from hybridserve.sampling_params import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)

ACCEPTED = "accepted"  # the first item of a generate stream: the engine took the request
ELSEWHERE = "elsewhere"  # a targeted call's answer on a replica it was not meant for (its target is gone)
# engine stats a replica publishes with its summary (its load and its cache counters, for metrics)
PUBLISHED_STATS = ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total", "prefix_cache_queries",
                   "prefix_cache_hits", "prefix_cache_query_tokens", "prefix_cache_hit_tokens")


class EngineReplica:
    """One engine replica: `generate` streams, `call` and `stats` pass through, `check_health` and
    `record_routing_stats` serve Ray Serve."""

    def __init__(self, config: EngineConfig, engine_process: bool = False,
                 max_waiting_requests: int | None = None) -> None:
        from hybridserve.server.cli import start_engine  # the same start-up as `hybridserve serve`

        self.engine: EngineClient = start_engine(config, engine_process, max_waiting_requests)[0]
        self._epoch = 0
        self._summary_failed = False

    def describe(self) -> dict[str, Any]:
        """What the ingress needs to validate and render requests: tokenizer, model config, limits."""
        return {"tokenizer": self.engine.tokenizer, "model_config": self.engine.model_config,
                "max_model_len": self.engine.max_model_len, "max_request_tokens": self.engine.max_request_tokens,
                "max_waiting_requests": getattr(self.engine, "max_waiting_requests", None)}

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       cache_salt: str | None) -> AsyncIterator[RequestOutput | str]:
        """`ACCEPTED` once the engine took the request, then its outputs; a cancelled call (the
        client left, or the ingress aborted) aborts the request."""
        stream = await self.engine.add_request(request_id, prompt_ids, params, cache_salt)
        try:
            yield ACCEPTED
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.engine.abort(request_id)

    async def call(self, method: str, *args: Any) -> Any:
        """The engine's utility call."""
        return await self.engine.call(method, *args)

    async def call_on(self, target: str, method: str, *args: Any) -> Any:
        """The engine's utility call on the replica named `target` (`JointCacheRouter` sends it
        there, to reach every replica once); `ELSEWHERE` on any other (the target is gone)."""
        from ray import serve

        if str(serve.get_replica_context().replica_id.unique_id) != target:
            return ELSEWHERE
        return await self.engine.call(method, *args)

    async def stats(self) -> dict[str, float]:
        """The engine's stats."""
        return await self.engine.stats()

    def check_health(self) -> None:
        """Serve's health check: raises while the engine cannot serve (Serve then replaces this replica)."""
        problem = self.engine.health_problem
        if problem is not None:
            raise RuntimeError(f"engine unhealthy: {problem}")

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the router sees of this replica: the engine's joint-boundary summary (a newer epoch
        each time), its load and cache counters, and every engine stat for the ingress metrics."""
        self._epoch += 1
        stats = await self.engine.stats()
        published: dict[str, Any] = {"epoch": self._epoch, "stats": stats,
                                     "load": {key: stats.get(key, 0) for key in PUBLISHED_STATS}}
        try:
            published["summary"] = await self.engine.call("routing_summary", self._epoch)
        except Exception as exc:  # an engine without summaries still serves: it is routed by load
            if not self._summary_failed:
                logger.warning("no routing summary from the engine (%s): routed by load only", exc)
            self._summary_failed = True
        return published

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

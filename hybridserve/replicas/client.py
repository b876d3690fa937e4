"""`ReplicaEngineClient`: an `EngineClient` (engine/protocol.py) over the replica deployment's handle,
so the ingress serves the unchanged FastAPI app of `hybridserve.server` in front of N replicas.
A request is one streaming `generate` call, routed by `JointCacheRouter`; aborting it cancels the
call (the replica aborts the engine request); a replica that dies fails its streams with
`EngineDeadError`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from hybridserve.engine.protocol import generate_outputs
from hybridserve.errors import EngineDeadError, HybridServeError, InvalidRequestError
from hybridserve.replicas.registry import active_routers
from hybridserve.replicas.replica import ACCEPTED, ELSEWHERE
from hybridserve.sampling_params import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)

SUBMIT_ATTEMPTS = 3  # a request whose replica is lost before it accepted is submitted again this often
SUMMED_STATS_SKIP = ("bytes_per_snapshot",)  # per-replica constants: reported once, not summed


def replica_lost(exc: BaseException) -> bool:
    """Whether a call failed because its replica died or could not be reached."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(exc, (ActorDiedError, ActorUnavailableError, RayActorError))


def engine_error(exc: BaseException) -> BaseException:
    """The engine error a failed replica call stands for: the replica's own hybridserve or value
    error as raised there, a dead or unreachable replica as `EngineDeadError`."""
    from ray.exceptions import RayTaskError

    if isinstance(exc, RayTaskError):
        cause = exc.cause if isinstance(exc.cause, BaseException) else None
        if isinstance(cause, (HybridServeError, ValueError, TimeoutError)):
            return cause
    if isinstance(exc, (HybridServeError, ValueError)):
        return exc
    if replica_lost(exc):
        return EngineDeadError(f"engine replica lost: {type(exc).__name__}")
    return EngineDeadError(f"engine replica failed: {type(exc).__name__}: {exc}")


class ReplicaStream:
    """One request's outputs from a replica (`RequestOutputStream`); `finished` once the final one
    was taken. A replica failure mid-stream is raised as `EngineDeadError`."""

    def __init__(self, request_id: str, response: Any, on_done: Callable[[str], object] = lambda _: None) -> None:
        self.request_id = request_id
        self.finished = False
        self._response = response
        self._on_done = on_done

    def _finish(self) -> None:
        self.finished = True
        self._on_done(self.request_id)

    def __aiter__(self) -> ReplicaStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            output = await self._response.__anext__()
        except StopAsyncIteration:
            self._finish()
            raise EngineDeadError("engine replica ended the stream before its final output") from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._finish()
            raise engine_error(exc) from exc
        if output.finished:
            self._finish()
        return output  # type: ignore[no-any-return]  # the replica yields RequestOutputs after ACCEPTED

    def cancel(self) -> None:
        """Cancel the call (the replica aborts the engine request)."""
        self._response.cancel()


class ReplicaEngineClient:
    """The engine as the HTTP app sees it, with N engine replicas behind a Serve handle."""

    def __init__(self, handle: Any, description: dict[str, Any]) -> None:
        self._handle = handle
        self._streaming = handle.options(stream=True)
        self.tokenizer = description["tokenizer"]
        self.model_config = description["model_config"]
        self.max_model_len = int(description["max_model_len"])
        self.max_request_tokens = int(description["max_request_tokens"])
        self.max_waiting_requests: int | None = description.get("max_waiting_requests")
        self._streams: dict[str, ReplicaStream] = {}
        self._stopped = False

    @classmethod
    async def connect(cls, handle: Any) -> ReplicaEngineClient:
        """A client for the deployment behind `handle`, described by one of its replicas."""
        return cls(handle, await handle.describe.remote())

    @property
    def is_running(self) -> bool:
        """True until shut down (a dead replica is Ray's to replace; the others serve on)."""
        return not self._stopped

    @property
    def dead_reason(self) -> str | None:
        """Why this client stopped (None while it serves)."""
        return "the ingress has been shut down" if self._stopped else None

    @property
    def health_problem(self) -> str | None:
        """Why the probes fail: shut down, or no replica reported so far."""
        if self._stopped:
            return "engine is not running: the ingress has been shut down"
        routers = active_routers()
        if routers and not any(router.snapshot().replica_stats for router in routers):
            return "no engine replica has reported yet"
        return None

    @property
    def num_waiting_estimate(self) -> int:
        """Requests waiting in the replicas' engines, as last reported."""
        return int(self._summed_stats().get("num_waiting", 0))

    def start(self) -> None:
        """Nothing to start: the replicas run under Ray Serve."""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Cancel the requests in flight; the replicas stay with Serve."""
        self._stopped = True
        for stream in list(self._streams.values()):
            stream.cancel()
        self._streams.clear()

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          cache_salt: str | None = None) -> ReplicaStream:
        """Submit to the replica the router chooses, once its engine accepted the request; a replica
        lost before accepting it (nothing was sent to the client yet) is tried again elsewhere."""
        if self._stopped:
            raise EngineDeadError("the ingress has been shut down")
        prompt_ids = list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
        for attempt in range(1, SUBMIT_ATTEMPTS + 1):
            response = self._streaming.generate.remote(request_id, prompt_ids, params, cache_salt)
            try:
                first = await response.__anext__()
            except asyncio.CancelledError:
                response.cancel()
                raise
            except Exception as exc:
                if attempt < SUBMIT_ATTEMPTS and replica_lost(exc):
                    logger.warning("request %s: engine replica lost before accepting it, submitting again",
                                   request_id)
                    continue
                raise engine_error(exc) from exc
            if first != ACCEPTED:
                response.cancel()
                raise EngineDeadError(f"engine replica answered {type(first).__name__} before accepting")
            stream = ReplicaStream(request_id, response, self._forget)
            self._streams[request_id] = stream
            return stream
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit and yield outputs until the request finishes; leaving early aborts it."""
        async for output in generate_outputs(self, request_id, prompt, params, cache_salt):
            yield output

    def abort(self, request_id: str) -> None:
        """Abort a request (unknown or finished ids are a no-op)."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            stream.cancel()

    def _forget(self, request_id: str) -> None:
        """A stream ended: nothing to abort for it any more."""
        self._streams.pop(request_id, None)

    async def call(self, method: str, *args: Any) -> Any:
        """Call an engine method on one replica (the least loaded)."""
        try:
            return await self._handle.call.remote(method, *args)
        except Exception as exc:
            raise engine_error(exc) from exc

    async def stats(self) -> dict[str, float]:
        """Every replica's engine stats as last published, summed (counters and pool sizes)."""
        return self._summed_stats()

    def _summed_stats(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for router in active_routers():
            for stats in router.snapshot().replica_stats.values():
                for key, value in stats.items():
                    if isinstance(value, (int, float)):
                        total[key] = value if key in SUMMED_STATS_SKIP else total.get(key, 0.0) + value
        return total

    async def check_integrity(self) -> None:
        """The integrity checks of one replica's engine."""
        await self.call("check_integrity")

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_tiers: bool = False) -> bool:
        """Reset every replica's prefix cache (`LLMEngine.reset_prefix_cache`), each reached by name
        through the joint router; True when every one reset or is gone. The router's view of what
        each holds catches up with the replicas' next summaries."""
        names = sorted({name for router in active_routers() for name in router.snapshot().replicas})
        if not names:
            raise InvalidRequestError("resetting the replicas' prefix caches needs the joint router "
                                      "(--router joint), which reaches each replica by name")
        args = ("reset_prefix_cache", reset_running_requests, reset_tiers)
        try:
            answers = await asyncio.gather(*(self._handle.call_on.remote(name, *args) for name in names))
        except Exception as exc:
            raise engine_error(exc) from exc
        gone = [name for name, answer in zip(names, answers) if answer == ELSEWHERE]
        if gone:  # its cache went with it
            logger.info("reset_prefix_cache: replica(s) %s left before their reset", ", ".join(gone))
        return all(answer is True or answer == ELSEWHERE for answer in answers)

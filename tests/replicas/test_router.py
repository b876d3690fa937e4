"""The replica layer without a cluster: `JointCacheRouter` choosing among fake replicas from their
summaries, recent routes and loads; `RecentRoutes`; the metrics families; the start-up checks and
how replica failures map to engine errors. Fast (imports Ray, starts nothing)."""

from __future__ import annotations

import asyncio
from typing import Any, NamedTuple

import pytest

pytest.importorskip("ray.serve", reason="the replica tests need `pip install hybridserve[ray]`")

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from ray.exceptions import ActorDiedError, RayTaskError  # noqa: E402
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from hybridserve.cache.block_pool import block_hashes_for, engine_block_hash  # noqa: E402
from hybridserve.config import CacheConfig, EngineConfig  # noqa: E402
from hybridserve.errors import EngineDeadError, InvalidRequestError  # noqa: E402
from hybridserve.replicas.client import engine_error  # noqa: E402
from hybridserve.replicas.hints import RecentRoutes  # noqa: E402
from hybridserve.replicas.launch import ReplicaSetupError, check_resources, with_shared_seed  # noqa: E402
from hybridserve.replicas.metrics import ReplicaMetricsCollector  # noqa: E402
from hybridserve.replicas.registry import RouterSnapshot  # noqa: E402
from hybridserve.replicas.router import JointCacheRouter  # noqa: E402
from hybridserve.routing.summary import JointBoundary, encode_summary, hash_identity  # noqa: E402
from hybridserve.sampling_params import SamplingParams  # noqa: E402
from tests.helpers.live_server import random_ids  # noqa: E402

BLOCK, SEED = 16, 0x5EED
DEPLOYMENT = DeploymentID(name="engine", app_name="test")


class FakeReplica(NamedTuple):
    """What the router reads of a Serve replica."""

    replica_id: ReplicaID


def _router() -> JointCacheRouter:
    router = JointCacheRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(block_size=BLOCK, block_hash_seed=SEED, router_config={"min_hit_tokens": 32})
    return router


def _replica(name: str) -> FakeReplica:
    return FakeReplica(ReplicaID(unique_id=name, deployment_id=DEPLOYMENT))


def _summary(prompt: list[int], blocks: int, epoch: int, salt: str | None = None) -> dict[str, Any]:
    """A replica summary holding one joint boundary: `blocks` full blocks of `prompt`."""
    algorithm = engine_block_hash("xxh3_128", SEED)
    hashes = block_hashes_for(prompt[:blocks * BLOCK], BLOCK, () if salt is None else (salt,), algorithm=algorithm)
    boundary = JointBoundary(hashes[-1], None, blocks * BLOCK, "device")
    return encode_summary([boundary], BLOCK, epoch, hash_identity(algorithm))


def _route(router: JointCacheRouter, replicas: list[FakeReplica], prompt: list[int], salt: str | None = None,
           request_id: str = "r") -> str:
    """Route one generate call as Serve does: choose, then report it routed; the replica's name."""

    async def route() -> str:
        metadata = RequestMetadata(request_id=request_id, internal_request_id=request_id, call_method="generate")
        pending = PendingRequest(args=[request_id, prompt, SamplingParams(max_tokens=8), salt], kwargs={},
                                 metadata=metadata)
        ranks = await router.choose_replicas(replicas, pending)  # type: ignore[arg-type]
        assert sorted(r[0].replica_id.unique_id for r in ranks) == sorted(r.replica_id.unique_id for r in replicas)
        chosen = ranks[0][0].replica_id
        router.on_request_routed(pending, chosen, None)
        return str(chosen.unique_id)

    return asyncio.run(route())


def test_router_follows_joint_hits_then_recent_routes_and_drops_dead_replicas() -> None:
    router = _router()
    replicas = [_replica("a"), _replica("b")]
    prompt = random_ids(1, 200)
    router.take_stats("b", {"summary": _summary(prompt, 8, epoch=1), "stats": {"num_waiting": 0}})
    router.take_stats("a", {"summary": _summary(prompt, 2, epoch=1), "stats": {}})
    assert _route(router, replicas, prompt, request_id="1") == "b"            # the deeper joint hit
    router.on_request_completed(replicas[1].replica_id, "1")
    # a stale summary (older epoch) does not replace the view
    router.take_stats("b", {"summary": _summary(prompt, 1, epoch=0), "stats": {}})
    assert _route(router, replicas, prompt + [5], request_id="2") == "b"
    router.on_request_completed(replicas[1].replica_id, "2")
    # another tenant's prompt matches nothing of this one: no hit
    other = _route(router, replicas, prompt, salt="tenant-b", request_id="3")
    router.on_request_completed(_replica(other).replica_id, "3")
    # a prompt routed lately counts before any summary shows it
    fresh = random_ids(2, 120)
    first = _route(router, replicas, fresh, request_id="4")
    router.on_request_completed(_replica(first).replica_id, "4")
    assert _route(router, replicas, fresh + random_ids(3, 40), request_id="5") == first
    snapshot = router.snapshot()
    assert snapshot.decisions == {"joint_hit": 2, "no_hit": 2, "recent_route": 1}
    assert snapshot.in_flight[first] == 1
    router.on_request_completed(_replica(first).replica_id, "5")
    assert router.snapshot().in_flight[first] == 0
    # a dead replica is forgotten: its hits no longer attract, the survivor takes everything
    router.on_replica_actor_died(replicas[1].replica_id)
    assert "b" not in router.index.replicas and "b" not in router.snapshot().replica_stats
    assert _route(router, [replicas[0]], prompt, request_id="6") == "a"


def test_a_targeted_call_goes_to_the_replica_it_names() -> None:
    """`call_on(name, ...)` reaches that replica whatever the loads; a gone name falls back to the
    least loaded (which answers that it is not the target). The router lists its replicas by name."""
    router = _router()
    replicas = [_replica("a"), _replica("b")]

    async def choose(target: str) -> list[str]:
        metadata = RequestMetadata(request_id="t", internal_request_id="t", call_method="call_on")
        pending = PendingRequest(args=[target, "reset_prefix_cache", False, False], kwargs={}, metadata=metadata)
        ranks = await router.choose_replicas(replicas, pending)  # type: ignore[arg-type]
        return [str(rank[0].replica_id.unique_id) for rank in ranks]

    assert asyncio.run(choose("b")) == ["b"] and asyncio.run(choose("a")) == ["a"]
    assert sorted(asyncio.run(choose("gone"))) == ["a", "b"]
    assert router.snapshot().replicas == ()  # none reported by Serve yet

    class Running:
        """The part of a Serve `RunningReplica` that `update_replicas` reads."""

        def __init__(self, name: str) -> None:
            self.replica_id, self.routing_stats, self.max_ongoing_requests = _replica(name).replica_id, None, 8

        async def get_queue_len(self, *, deadline_s: float) -> int:
            return 0

    async def update() -> None:
        router.update_replicas([Running("b"), Running("a")])  # type: ignore[list-item]

    asyncio.run(update())
    assert router.snapshot().replicas == ("a", "b")


def test_router_tolerates_a_malformed_summary() -> None:
    router = _router()
    router.take_stats("a", {"summary": {"format": 99}, "stats": {"num_running": 1}})
    router.take_stats("b", {})  # not published yet
    assert router.snapshot().replica_stats == {"a": {"num_running": 1}}


def test_recent_routes_expire_and_stay_per_tenant() -> None:
    now = [0.0]
    routes = RecentRoutes(BLOCK, ttl_s=5, max_hashes=4, clock=lambda: now[0])
    chunk = routes.chunk_tokens
    prompt = random_ids(4, 6 * chunk + 10)
    routes.add("a", routes.hashes(prompt, None))
    assert routes.depths(routes.hashes(prompt + [1, 2], None)) == {"a": 6 * chunk}
    assert routes.depths(routes.hashes(prompt[:3 * chunk + 1], None)) == {"a": 3 * chunk}
    assert routes.depths(routes.hashes(prompt[:2 * chunk + 1], None)) == {}  # only the last 4 hashes are kept
    assert routes.depths(routes.hashes(prompt[:chunk] + [7] + prompt[chunk + 1:], None)) == {}  # diverged early
    assert routes.depths(routes.hashes(prompt, "other tenant")) == {}
    now[0] = 6.0
    assert routes.depths(routes.hashes(prompt, None)) == {}


def test_metrics_families_per_replica_and_reason() -> None:
    snapshot = RouterSnapshot({"joint_hit": 3, "no_hit": 1},
                              {"a": {"prefix_cache_query_tokens": 400, "prefix_cache_hit_tokens": 100,
                                     "tier_remote_hits": 2}, "b": {"prefix_cache_query_tokens": 0}},
                              {"a": 1})
    registry = CollectorRegistry()
    registry.register(ReplicaMetricsCollector(lambda: [snapshot]))
    text = generate_latest(registry).decode()
    assert 'hybridserve_replica_prefix_cache_hit_rate{replica="a"} 0.25' in text
    assert 'hybridserve_replica_prefix_cache_hit_rate{replica="b"} 0.0' in text
    assert 'hybridserve_replica_requests_in_flight{replica="b"} 0.0' in text
    assert 'hybridserve_router_decisions_total{reason="joint_hit"} 3.0' in text
    assert 'hybridserve_replica_store_hits{replica="a"} 2.0' in text


def test_start_up_checks() -> None:
    check_resources(2, {"num_cpus": 1, "num_gpus": 0}, {"CPU": 2})
    with pytest.raises(ReplicaSetupError, match="2 replicas need 4 GPUs \\(2 each\\); the Ray cluster has 2"):
        check_resources(2, {"num_cpus": 1, "num_gpus": 2}, {"CPU": 8, "GPU": 2})
    with pytest.raises(ReplicaSetupError, match="--replicas must be >= 1"):
        check_resources(0, {"num_cpus": 1, "num_gpus": 0}, {"CPU": 2})
    seeded = with_shared_seed(EngineConfig())
    assert seeded.cache.block_hash_seed is not None
    assert with_shared_seed(seeded) == seeded
    assert with_shared_seed(EngineConfig(cache=CacheConfig(block_hash="sha256"))).cache.block_hash_seed is None


def test_replica_failures_map_to_engine_errors() -> None:
    bad = InvalidRequestError("prompt too long")
    assert engine_error(RayTaskError("generate", "traceback", bad)) is bad
    lost = engine_error(ActorDiedError())
    assert isinstance(lost, EngineDeadError) and "replica lost" in str(lost)
    assert isinstance(engine_error(RuntimeError("boom")), EngineDeadError)


class FakeResponse:
    """A streaming handle call's response: yields `items`, raising any that is an exception."""

    def __init__(self, items: list[Any]) -> None:
        self.items = list(items)
        self.cancelled = False

    async def __anext__(self) -> Any:
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """The replica deployment's handle as `ReplicaEngineClient` uses it: one response per call."""

    def __init__(self, responses: list[FakeResponse]) -> None:
        self.responses = responses
        self.calls = 0
        self.generate = self

    def options(self, stream: bool) -> FakeHandle:
        return self

    def remote(self, *args: Any) -> FakeResponse:
        self.calls += 1
        return self.responses.pop(0)


def _client(responses: list[FakeResponse]) -> tuple[Any, FakeHandle]:
    from hybridserve.replicas.client import ReplicaEngineClient

    handle = FakeHandle(responses)
    description = {"tokenizer": None, "model_config": None, "max_model_len": 64, "max_request_tokens": 64}
    return ReplicaEngineClient(handle, description), handle


def test_client_resubmits_when_a_replica_is_lost_before_accepting() -> None:
    from hybridserve.replicas.replica import ACCEPTED
    from hybridserve.sampling_params import CompletionOutput, RequestOutput

    final = RequestOutput("r", None, [1, 2], [CompletionOutput(0, "x", [3], None, None, "length")], finished=True)
    client, handle = _client([FakeResponse([ActorDiedError()]), FakeResponse([ACCEPTED, final])])

    async def run() -> list[Any]:
        stream = await client.add_request("r", [1, 2], SamplingParams(max_tokens=1))
        return [output async for output in stream]

    assert asyncio.run(run()) == [final]
    assert handle.calls == 2 and not client._streams


def test_client_fails_a_stream_whose_replica_dies_with_engine_dead() -> None:
    from hybridserve.replicas.replica import ACCEPTED

    lost_mid_stream = FakeResponse([ACCEPTED, ActorDiedError()])
    refused = FakeResponse([RayTaskError("generate", "tb", InvalidRequestError("bad prompt"))])
    client, handle = _client([lost_mid_stream, refused])

    async def run() -> None:
        stream = await client.add_request("a", [1], SamplingParams(max_tokens=1))
        with pytest.raises(EngineDeadError, match="replica lost"):
            await stream.__anext__()
        assert stream.finished
        with pytest.raises(InvalidRequestError, match="bad prompt"):  # the replica's own error, not retried
            await client.add_request("b", [1], SamplingParams(max_tokens=1))

    asyncio.run(run())
    assert handle.calls == 2
    # an abort cancels the call of a running stream
    running = FakeResponse([ACCEPTED])
    client, _ = _client([running])

    async def abort() -> None:
        await client.add_request("c", [1], SamplingParams(max_tokens=1))
        client.abort("c")

    asyncio.run(abort())
    assert running.cancelled


def test_a_reset_is_sent_to_every_replica_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """One targeted call per replica the router lists; True when each reset or is gone (`ELSEWHERE`),
    False when one refused (its requests run); without the joint router, a clear error."""
    from hybridserve.replicas import client as client_module
    from hybridserve.replicas.replica import ELSEWHERE

    client, _ = _client([])
    sent: list[tuple[Any, ...]] = []

    def targeted(answers: dict[str, Any]) -> Any:
        class CallOn:
            async def remote(self, name: str, *args: Any) -> Any:
                sent.append((name, *args))
                return answers[name]

        return CallOn()

    snapshot = RouterSnapshot({}, {}, {}, ("a", "b"))
    monkeypatch.setattr(client_module, "active_routers", lambda: [type("R", (), {"snapshot": lambda self: snapshot})()])
    client._handle.call_on = targeted({"a": True, "b": True})
    assert asyncio.run(client.reset_prefix_cache(True, False))
    assert sorted(sent) == [("a", "reset_prefix_cache", True, False), ("b", "reset_prefix_cache", True, False)]
    client._handle.call_on = targeted({"a": True, "b": ELSEWHERE})
    assert asyncio.run(client.reset_prefix_cache())
    client._handle.call_on = targeted({"a": False, "b": True})
    assert not asyncio.run(client.reset_prefix_cache())
    monkeypatch.setattr(client_module, "active_routers", lambda: [])
    with pytest.raises(InvalidRequestError, match="joint router"):
        asyncio.run(client.reset_prefix_cache())

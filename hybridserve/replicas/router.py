"""`JointCacheRouter`: a Ray Serve request router, in the ingress's process, that sends each engine
request to the replica holding the deepest *joint* prefix hit for its prompt against that replica's
load (docs/serving.md, "Routing by joint hits"). Its decisions are counted for the ingress through
`registry` (Serve pickles this module by value, so module globals here would be copies).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from hybridserve.cache.block_pool import engine_block_hash
from hybridserve.replicas import registry
from hybridserve.replicas.hints import DEFAULT_TTL_S, RecentRoutes
from hybridserve.routing.index import JointIndex
from hybridserve.routing.policy import LOAD_HALF_LIFE_S, OutstandingWork, RouterConfig, choose_replica

logger = logging.getLogger(__name__)

GENERATE_METHOD = "generate"  # the replica method that carries a prompt (EngineReplica.generate)
TARGETED_METHOD = "call_on"   # the replica method that names its replica first (EngineReplica.call_on)
PROMPT_ARG, PARAMS_ARG, SALT_ARG = 1, 2, 3  # of generate(request_id, prompt_ids, params, cache_salt)
REASON_RECENT = "recent_route"  # chosen for a prompt routed there lately, its summary not in yet

def replica_name(replica_id: ReplicaID) -> str:
    """The name a replica goes by in the index, the hints and the metrics."""
    return str(replica_id.unique_id)


class JointCacheRouter(FIFOMixin, RequestRouter):
    """Routes `generate` calls by joint-cache depth against load, a targeted call (`call_on`) to the
    replica it names, other calls to the least loaded."""

    def initialize_state(self, block_size: int = 16, block_hash: str = "xxh3_128",
                         block_hash_seed: int | None = None, router_config: dict[str, Any] | None = None,
                         hint_ttl_s: float = DEFAULT_TTL_S, **_: Any) -> None:
        """Set up from `request_router_kwargs`: the engines' block size and (shared) block-hash seed,
        `RouterConfig` fields, and how long a routed prompt counts as held before its summary."""
        algorithm = engine_block_hash(block_hash, block_hash_seed)
        self.block_size = block_size
        self.index = JointIndex(block_size, algorithm)
        self.config = RouterConfig(**(router_config or {}))
        self.hints = RecentRoutes(block_size, hint_ttl_s)
        self._lock = threading.Lock()  # the metrics reader runs on another thread
        self._decisions: collections.Counter[str] = collections.Counter()
        self._stats: dict[str, dict[str, float]] = {}
        self._in_flight: collections.Counter[str] = collections.Counter()
        # loads: prefill-token equivalents sent and not finished, plus recent work decayed, as in the sim
        # the policy's defaults were chosen with (`hybridserve sim --load-half-life-s`)
        self._work = OutstandingWork(half_life=LOAD_HALF_LIFE_S)
        self._turn = 0  # rotates ties among idle replicas
        # internal id of a generate call being routed -> (reason, prompt hint hashes, work if uncached, depths)
        self._pending: dict[str, tuple[str, list[int], float, dict[str, int]]] = {}
        self._routed: dict[str, str] = {}  # internal id of a generate call in flight -> replica name
        self._names: tuple[str, ...] = ()  # the replicas Serve gave it last
        registry.register(self)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new replica set (with fresh `routing_stats`): feed the index, drop the gone."""
        super().update_replicas(replicas)
        names = set()
        for replica in replicas:
            name = replica_name(replica.replica_id)
            names.add(name)
            self.index.add_replica(name)
            self._work.add_replica(name)
            self.take_stats(name, replica.routing_stats)
        with self._lock:
            self._names = tuple(sorted(names))
        for name in set(self._stats) | set(self.hints.replicas()):
            if name not in names:
                self._forget(name)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """A replica died: it is chosen no more, and what it held is forgotten."""
        super().on_replica_actor_died(replica_id)
        self._forget(replica_name(replica_id))

    def take_stats(self, name: str, routing_stats: dict[str, Any] | None) -> None:
        """Take what a replica published (`EngineReplica.record_routing_stats`): its summary into the
        index (an older epoch or a malformed one is ignored), its engine stats for the metrics."""
        if not routing_stats:
            return  # not published yet, or the last call failed: keep the previous view
        summary = routing_stats.get("summary")
        if summary is not None:
            try:
                self.index.update(name, summary)
            except (KeyError, TypeError, ValueError) as exc:  # a malformed summary is a lost one
                logger.warning("replica %s: summary ignored (%s)", name, exc)
        with self._lock:
            self._stats[name] = dict(routing_stats.get("stats") or {})

    def _forget(self, name: str) -> None:
        self.index.remove(name)
        self.hints.remove(name)
        self._work.remove_replica(name)
        with self._lock:
            self._stats.pop(name, None)
            self._in_flight.pop(name, None)

    def _loads(self, replicas: Sequence[RunningReplica]) -> dict[str, float]:
        """Each replica's outstanding work from this router (prefill-token equivalents)."""
        work = self._work.loads()
        return {name: work.get(name, 0.0) for name in (replica_name(r.replica_id) for r in replicas)}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """The chosen replica first, then the others by load (Serve tries them in order when full)."""
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        loads = self._loads(candidate_replicas)
        by_name = {replica_name(r.replica_id): r for r in candidate_replicas}
        by_load = sorted(candidate_replicas, key=lambda r: loads[replica_name(r.replica_id)])
        target = _target_of(pending_request)
        if target in by_name:
            return [[by_name[target]]]
        prompt = _prompt_of(pending_request)
        if prompt is None:
            return [[replica] for replica in by_load]
        token_ids, cache_salt, max_tokens = prompt
        chosen, reason, hashes, depths = self._decide(token_ids, cache_salt, loads)
        assert pending_request is not None
        self._pending[pending_request.metadata.internal_request_id] = (
            reason, hashes, float(len(token_ids) + max_tokens), depths)
        first = by_name[chosen]
        return [[first]] + [[replica] for replica in by_load if replica is not first]

    def _decide(self, token_ids: Sequence[int], cache_salt: str | None,
                loads: dict[str, float]) -> tuple[str, str, list[int], dict[str, int]]:
        """(replica, reason, the prompt's hint hashes, depths) for one prompt among the `loads` replicas."""
        joint = self.index.depths(token_ids, cache_salt)
        hashes = self.hints.hashes(token_ids, cache_salt)
        recent = self.hints.depths(hashes)
        depths = {name: max(joint.get(name, 0), recent.get(name, 0)) for name in loads}
        decision = choose_replica(depths, loads, len(token_ids), self.config, self._turn)
        self._turn += 1
        reason = decision.reason
        if reason == "joint_hit" and not self.config.useful(joint.get(decision.replica, 0), len(token_ids)):
            reason = REASON_RECENT  # only the recent route made it a useful hit
        return decision.replica, reason, hashes, depths

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Count the decision, remember the prompt as held by the replica it went to."""
        internal_id = pending_request.metadata.internal_request_id
        pending = self._pending.pop(internal_id, None)
        if pending is None:
            return
        reason, hashes, work, depths = pending
        name = replica_name(replica_id)
        self.hints.add(name, hashes)
        self._work.start(internal_id, name, work - depths.get(name, 0))
        with self._lock:
            self._decisions[reason] += 1
            self._in_flight[name] += 1
        self._routed[internal_id] = name

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """A generate call ended (finished, failed or cancelled): one less in flight there."""
        name = self._routed.pop(internal_request_id, None)
        self._work.finish(internal_request_id)
        if name is not None:
            with self._lock:
                if self._in_flight[name] > 0:
                    self._in_flight[name] -= 1

    def snapshot(self) -> registry.RouterSnapshot:
        """A copy of the decisions and per-replica state, safe to read from another thread."""
        with self._lock:
            return registry.RouterSnapshot(dict(self._decisions), {k: dict(v) for k, v in self._stats.items()},
                                           dict(self._in_flight), self._names)


def _prompt_of(pending_request: PendingRequest | None) -> tuple[list[int], str | None, int] | None:
    """The prompt token ids, cache salt and output budget of a `generate` call (None for any other call)."""
    if pending_request is None or pending_request.metadata.call_method != GENERATE_METHOD:
        return None
    args = pending_request.args
    if len(args) <= SALT_ARG or not isinstance(args[PROMPT_ARG], list):
        return None
    salt = args[SALT_ARG]
    max_tokens = getattr(args[PARAMS_ARG], "max_tokens", None)
    return args[PROMPT_ARG], salt if isinstance(salt, str) else None, int(max_tokens or 0)


def _target_of(pending_request: PendingRequest | None) -> str | None:
    """The replica a targeted call names (None for any other call)."""
    if pending_request is None or pending_request.metadata.call_method != TARGETED_METHOD:
        return None
    args = pending_request.args
    return args[0] if args and isinstance(args[0], str) else None

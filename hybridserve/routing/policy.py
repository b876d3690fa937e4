"""Choosing a replica from its joint-hit depth and its load, both in prefill-token equivalents: the
cheapest replica (load minus what its hit saves) wins, within a load cap (docs/serving.md, "The routing policy").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

JOINT_HIT = "joint_hit"
LOAD_FALLBACK = "load_fallback"
NO_HIT = "no_hit"
LOAD_HALF_LIFE_S = 60.0  # default half-life of the recent-work term of a replica's load (`OutstandingWork`)


class RoutingDecision(NamedTuple):
    """Where a request goes and why: "joint_hit" (the deepest useful hit), "load_fallback" (a useful
    hit existed, load sent it elsewhere) or "no_hit" (no useful hit: the least loaded)."""

    replica: str
    reason: str


@dataclass(frozen=True)
class RouterConfig:
    """Thresholds of `choose_replica` (loads in prefill-token equivalents)."""

    min_hit_tokens: int = 256        # a shallower hit is not worth routing for
    min_hit_share: float = 0.05      # ... nor one covering less of the prompt than this share
    hit_weight: float = 8.0          # queued tokens a replica may carry per hit token it saves
    hit_bonus: float = 1024.0        # extra queued tokens tolerated for holding a useful hit at all
    max_load_ratio: float = 1.25     # past this times the mean load (+ hit_bonus), a hit does not attract

    def __post_init__(self) -> None:
        if self.min_hit_tokens < 0 or self.min_hit_share < 0 or self.hit_weight < 0 or self.hit_bonus < 0:
            raise ValueError("router thresholds must be >= 0")
        if self.max_load_ratio < 1:
            raise ValueError(f"max_load_ratio must be >= 1, got {self.max_load_ratio}")

    def useful(self, depth: int, prompt_tokens: int) -> bool:
        """Whether a hit of `depth` tokens is worth routing a `prompt_tokens` prompt for."""
        return depth > 0 and depth >= self.min_hit_tokens and depth >= self.min_hit_share * prompt_tokens


def choose_replica(depths: Mapping[str, int], loads: Mapping[str, float], prompt_tokens: int,
                   config: RouterConfig, turn: int = 0) -> RoutingDecision:
    """The replica for a prompt among those in `loads` (a replica missing from `depths` has no
    hit). Ties go to the first in `loads`' order rotated by `turn` (pass a counter so idle replicas
    share the no-hit traffic)."""
    names = list(loads)
    if not names:
        raise ValueError("no replica to route to")
    shift = turn % len(names)
    order = names[shift:] + names[:shift]
    cap = max(prompt_tokens - 1, 0)
    depth = {name: min(depths.get(name, 0), cap) for name in order}
    least = min(order, key=lambda name: (loads[name], -depth[name]))
    deepest = max(depth.values())
    if not config.useful(deepest, prompt_tokens):
        return RoutingDecision(least, NO_HIT)
    limit = config.max_load_ratio * sum(loads.values()) / len(order) + config.hit_bonus

    def cost(name: str) -> float:
        if not config.useful(depth[name], prompt_tokens) or loads[name] > limit:
            return loads[name]
        return loads[name] - config.hit_weight * depth[name] - config.hit_bonus

    choice = min(order, key=lambda name: (cost(name), -depth[name], loads[name]))
    return RoutingDecision(choice, JOINT_HIT if depth[choice] == deepest else LOAD_FALLBACK)


class OutstandingWork:
    """A router's count of each replica's outstanding work: add a request when it is routed (its
    uncached prompt tokens plus its output budget), finish it when its response ends. With
    `half_life` > 0 (seconds of `clock`), a replica's load also carries the work sent to it
    recently, decayed, as `hybridserve sim --load-half-life-s` models it: when queues stay short,
    the outstanding work alone cannot tell a replica that attracts every conversation from an idle one."""

    def __init__(self, half_life: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        if half_life < 0:
            raise ValueError(f"half_life must be >= 0, got {half_life}")
        self.half_life = half_life
        self._clock = clock
        self._loads: dict[str, float] = {}
        self._recent: dict[str, float] = {}
        self._recent_at = clock()
        self._requests: dict[str, tuple[str, float]] = {}

    def add_replica(self, replica: str) -> None:
        """Start counting `replica` (idle)."""
        self._loads.setdefault(replica, 0.0)
        self._recent.setdefault(replica, 0.0)

    def remove_replica(self, replica: str) -> None:
        """Stop counting `replica` and forget its requests."""
        self._loads.pop(replica, None)
        self._recent.pop(replica, None)
        self._requests = {key: value for key, value in self._requests.items() if value[0] != replica}

    def start(self, request_id: str, replica: str, work: float) -> None:
        """`request_id` went to `replica` carrying `work` tokens."""
        self.add_replica(replica)
        self._loads[replica] += work
        self._requests[request_id] = (replica, work)
        if self.half_life:
            self._decay()
            self._recent[replica] += work

    def finish(self, request_id: str) -> None:
        """`request_id` ended (finished, failed or aborted); unknown ids are ignored."""
        entry = self._requests.pop(request_id, None)
        if entry is not None and entry[0] in self._loads:
            self._loads[entry[0]] = max(0.0, self._loads[entry[0]] - entry[1])

    def loads(self) -> dict[str, float]:
        """Outstanding work per replica (plus its decayed recent work with a half-life)."""
        if not self.half_life:
            return dict(self._loads)
        self._decay()
        return {replica: load + self._recent[replica] for replica, load in self._loads.items()}

    def _decay(self) -> None:
        now = self._clock()
        factor = 0.5 ** (max(0.0, now - self._recent_at) / self.half_life)
        self._recent = {replica: value * factor for replica, value in self._recent.items()}
        self._recent_at = now

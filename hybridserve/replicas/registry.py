"""The joint-cache routers of this process, and what they show of themselves. Serve ships a router
class to the handle's process pickled *by value* (its module's globals travel copied), so the
registry the ingress reads lives here, in a module imported by reference."""

from __future__ import annotations

import threading
from typing import Any, NamedTuple, Protocol


class RouterSnapshot(NamedTuple):
    """A copy of a router's state for metrics: decisions by reason, and per replica its last
    published engine stats and the requests in flight to it; the replicas' names."""

    decisions: dict[str, int]
    replica_stats: dict[str, dict[str, float]]
    in_flight: dict[str, int]
    replicas: tuple[str, ...] = ()  # the replicas it routes to now, by name


class SnapshotSource(Protocol):
    """A router as the ingress sees it."""

    def snapshot(self) -> RouterSnapshot:
        """Its state now (safe to call from any thread)."""


_lock = threading.Lock()
_routers: list[Any] = []


def register(router: SnapshotSource) -> None:
    """Add a router of this process (it registers itself when Serve sets it up)."""
    with _lock:
        _routers.append(router)


def active_routers() -> list[SnapshotSource]:
    """The joint-cache routers of this process."""
    with _lock:
        return list(_routers)

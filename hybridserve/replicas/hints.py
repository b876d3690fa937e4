"""Prompts the router sent to each replica lately, by block hash: what a replica is about to hold
before its next published summary says so (the summaries lag by the stats period). Plain Python."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence

from hybridserve.cache.block_pool import BlockHash, HashAlgorithm, block_hashes_for

DEFAULT_TTL_S = 15.0           # a hint lives this long: several stats periods, then the summary speaks
DEFAULT_MAX_HASHES = 1 << 16   # hashes kept per replica (least recently routed dropped first)


def extra_keys_for(cache_salt: str | None) -> tuple[object, ...]:
    """The extra hash keys of a prompt, as the engine salts a tenant's blocks."""
    return () if cache_salt is None else (cache_salt,)


class RecentRoutes:
    """Per replica, the full-block hashes of the prompts routed to it in the last `ttl_s` seconds.

    A hint is not a joint hit (the replica may not keep a state at that boundary), so the router
    uses it only to keep a conversation where it went while the replica's summary has not caught up.
    """

    def __init__(self, block_size: int, algorithm: HashAlgorithm, ttl_s: float = DEFAULT_TTL_S,
                 max_hashes: int = DEFAULT_MAX_HASHES, clock: Callable[[], float] = time.monotonic) -> None:
        self.block_size = block_size
        self.algorithm = algorithm
        self.ttl_s = ttl_s
        self.max_hashes = max_hashes
        self._clock = clock
        # replica -> block hash -> (tokens up to and including that block, when it was routed)
        self._routes: dict[str, collections.OrderedDict[BlockHash, tuple[int, float]]] = {}

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None) -> list[BlockHash]:
        """The full-block hashes a lookup of this prompt may hit (its last token is always computed)."""
        usable = token_ids[:max(0, len(token_ids) - 1)]
        return block_hashes_for(usable, self.block_size, extra_keys_for(cache_salt), algorithm=self.algorithm)

    def add(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        """Record that a prompt with these block hashes was sent to `replica`."""
        routes = self._routes.setdefault(replica, collections.OrderedDict())
        now = self._clock()
        for index, key in enumerate(hashes):
            routes[key] = ((index + 1) * self.block_size, now)
            routes.move_to_end(key)
        while len(routes) > self.max_hashes:
            routes.popitem(last=False)

    def depths(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Per replica with a fresh hint: tokens of the deepest block of this prompt routed to it."""
        oldest = self._clock() - self.ttl_s
        found: dict[str, int] = {}
        for replica, routes in self._routes.items():
            for key in reversed(hashes):
                hit = routes.get(key)
                if hit is not None and hit[1] >= oldest:
                    found[replica] = hit[0]
                    break
        return found

    def remove(self, replica: str) -> None:
        """Forget a replica (it died or left)."""
        self._routes.pop(replica, None)

    def replicas(self) -> list[str]:
        """Replicas with hints."""
        return list(self._routes)

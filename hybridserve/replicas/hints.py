"""Prompts the router sent to each replica lately, by chained chunk hashes: what a replica is about to
hold before its next published summary says so (the summaries lag by the stats period). Plain Python.

A hint is only a placement preference (never a cache key), so it hashes coarse chunks of
`HINT_BLOCKS` blocks with an unkeyed 64-bit hash seeded by the tenant's salt: a quarter of the
engine hash's calls, on the request path beside the `JointIndex` lookup."""

from __future__ import annotations

import array
import collections
import time
from collections.abc import Callable, Sequence

import xxhash

DEFAULT_TTL_S = 15.0           # a hint lives this long: several stats periods, then the summary speaks
DEFAULT_MAX_HASHES = 1 << 16   # hashes kept per replica (least recently routed dropped first)
HINT_BLOCKS = 4                # blocks per hashed chunk: a hint's depth is a multiple of this many blocks
TOKEN_BYTES = array.array("q").itemsize  # a token id in the hashed bytes


def salt_seed(cache_salt: str | None) -> int:
    """The first chunk's seed: one chain per tenant (a salted prompt never matches another tenant's)."""
    return 0 if cache_salt is None else xxhash.xxh3_64_intdigest(cache_salt.encode("utf-8", "surrogatepass"))


class RecentRoutes:
    """Per replica, the chunk hashes of the prompts routed to it in the last `ttl_s` seconds (not a
    joint hit: the router only keeps a conversation where it went until the summary catches up)."""

    def __init__(self, block_size: int, ttl_s: float = DEFAULT_TTL_S, max_hashes: int = DEFAULT_MAX_HASHES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.block_size = block_size
        self.chunk_tokens = block_size * HINT_BLOCKS
        self.ttl_s = ttl_s
        self.max_hashes = max_hashes
        self._clock = clock
        # replica -> chunk hash -> (tokens up to and including that chunk, when it was routed)
        self._routes: dict[str, collections.OrderedDict[int, tuple[int, float]]] = {}

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None) -> list[int]:
        """Chained hashes of the prompt's whole chunks a lookup may hit (its last token is always computed)."""
        usable = max(0, len(token_ids) - 1) // self.chunk_tokens * self.chunk_tokens
        data = array.array("q", token_ids[:usable]).tobytes()
        step = self.chunk_tokens * TOKEN_BYTES
        chained, out = salt_seed(cache_salt), []
        for start in range(0, len(data), step):
            chained = xxhash.xxh3_64_intdigest(data[start:start + step], seed=chained)
            out.append(chained)
        return out

    def add(self, replica: str, hashes: Sequence[int]) -> None:
        """Record that a prompt with these chunk hashes was sent to `replica`."""
        routes = self._routes.setdefault(replica, collections.OrderedDict())
        now = self._clock()
        for index, key in enumerate(hashes):
            routes[key] = ((index + 1) * self.chunk_tokens, now)
            routes.move_to_end(key)
        while len(routes) > self.max_hashes:
            routes.popitem(last=False)

    def depths(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per replica with a fresh hint: tokens of the deepest chunk of this prompt routed to it."""
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

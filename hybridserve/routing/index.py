"""The router's view of every replica's joint boundaries, built from their summaries. A prompt is
hashed once, with the engine's own block hash, and each boundary on its path is one dict lookup, so
a query costs O(prompt blocks), whatever the number of boundaries or replicas."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from hybridserve.cache.block_pool import BlockHash, HashAlgorithm, block_hashes_for, hash_tail
from hybridserve.routing.summary import JointBoundary, decode_summary, hash_identity


class _ReplicaView:
    """One replica's last accepted summary: its epoch and its boundaries by key."""

    def __init__(self, epoch: int, boundaries: dict[BlockHash, JointBoundary]) -> None:
        self.epoch = epoch
        self.boundaries = boundaries
        self.deepest = max((b.num_tokens for b in boundaries.values()), default=0)


class JointIndex:
    """Router-side view of every replica's joint boundaries, from summaries (stale or lost ones
    tolerated: an older epoch is ignored, a replica without a summary has depth 0). `algorithm`
    must be the replicas' block hash (the same seed), or nothing matches."""

    def __init__(self, block_size: int, algorithm: HashAlgorithm) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.algorithm = algorithm
        self.hash_id = hash_identity(algorithm)
        self._views: dict[str, _ReplicaView] = {}
        self._known: dict[str, None] = {}                       # every replica named, in order
        self._holders: dict[BlockHash, dict[str, int]] = {}     # key -> {replica: tokens}
        self._tail_lengths: dict[BlockHash, Counter[int]] = {}  # parent (b"" at the root) -> tail lengths
        self._deepest = 0                                       # no boundary lies deeper (no need to hash past it)

    @property
    def replicas(self) -> list[str]:
        """Replicas the index knows (with or without a summary)."""
        return list(self._known)

    def add_replica(self, replica: str) -> None:
        """Know `replica` before its first summary (its depth is 0 until one arrives)."""
        self._known.setdefault(replica, None)

    def epoch(self, replica: str) -> int | None:
        """Epoch of the summary in use for `replica`, or None."""
        view = self._views.get(replica)
        return view.epoch if view is not None else None

    def num_boundaries(self, replica: str) -> int:
        """Boundaries the index holds for `replica`."""
        view = self._views.get(replica)
        return len(view.boundaries) if view is not None else 0

    def update(self, replica: str, summary: dict[str, Any]) -> bool:
        """Replace `replica`'s view with `summary` when its epoch is newer than the one in use;
        whether it was taken. ValueError for a summary of another block size or block hash."""
        decoded = decode_summary(summary)
        if decoded.block_size != self.block_size:
            raise ValueError(f"replica {replica!r} summarises {decoded.block_size}-token blocks, "
                             f"the router hashes {self.block_size}-token blocks")
        if decoded.hash_id is not None and decoded.hash_id != self.hash_id:
            raise ValueError(f"replica {replica!r} hashes blocks with another algorithm or seed than the router "
                             "(every replica and the router need one --block-hash-seed)")
        self.add_replica(replica)
        current = self._views.get(replica)
        if current is not None and decoded.epoch <= current.epoch:
            return False
        self._drop(replica)
        self._add(replica, decoded.epoch, decoded.boundaries)
        return True

    def remove(self, replica: str) -> None:
        """Forget `replica` and its boundaries (its next summary starts afresh, any epoch)."""
        self._drop(replica)
        self._known.pop(replica, None)

    def _add(self, replica: str, epoch: int, boundaries: Iterable[JointBoundary]) -> None:
        by_key: dict[BlockHash, JointBoundary] = {}
        for boundary in boundaries:
            if boundary.key in by_key:
                continue
            by_key[boundary.key] = boundary
            self._holders.setdefault(boundary.key, {})[replica] = boundary.num_tokens
            length = boundary.num_tokens % self.block_size
            if length:
                self._tail_lengths.setdefault(boundary.parent or b"", Counter())[length] += 1
        self._views[replica] = _ReplicaView(epoch, by_key)
        self._deepest = max(view.deepest for view in self._views.values())

    def _drop(self, replica: str) -> None:
        view = self._views.pop(replica, None)
        if view is None:
            return
        self._deepest = max((other.deepest for other in self._views.values()), default=0)
        for key, boundary in view.boundaries.items():
            holders = self._holders[key]
            del holders[replica]
            if not holders:
                del self._holders[key]
            length = boundary.num_tokens % self.block_size
            if length:
                parent = boundary.parent or b""
                lengths = self._tail_lengths[parent]
                lengths[length] -= 1
                if lengths[length] <= 0:
                    del lengths[length]
                    if not lengths:
                        del self._tail_lengths[parent]

    def depths(self, token_ids: Sequence[int], cache_salt: str | None) -> dict[str, int]:
        """Per known replica: tokens of the deepest joint boundary it holds on this prompt's path,
        at most len(token_ids) - 1 (one token is always computed, as the engine's lookup does)."""
        depths = dict.fromkeys(self._known, 0)
        limit = len(token_ids) - 1
        if limit <= 0 or not self._holders:
            return depths
        size, algorithm = self.block_size, self.algorithm
        extra: tuple[object, ...] = () if cache_salt is None else (cache_salt,)
        full = min(limit, self._deepest) // size
        hashes = block_hashes_for(token_ids[:full * size], size, extra, algorithm=algorithm)
        # Only positions whose block hash some replica holds, or that some tail follows, need a look:
        # find them with C-level set operations, then walk them deepest first.
        position = {block_hash: blocks for blocks, block_hash in enumerate(hashes, 1)}
        ends = self._holders.keys() & position.keys()
        parents = self._tail_lengths.keys() & position.keys()
        candidates = sorted({position[h] for h in ends} | {position[h] for h in parents}, reverse=True)
        if b"" in self._tail_lengths:
            candidates.append(0)  # tails at the root
        left = len(depths)
        for blocks in candidates:
            parent = hashes[blocks - 1] if blocks else None
            if blocks == 0 or parent in parents:
                left -= self._tail_depths(depths, token_ids, parent, blocks * size, limit, extra)
            if blocks and parent in ends:
                left -= _assign(depths, self._holders[hashes[blocks - 1]], blocks * size)
            if left == 0:
                break
        return depths

    def _tail_depths(self, depths: dict[str, int], token_ids: Sequence[int], parent: BlockHash | None, start: int,
                     limit: int, extra: tuple[object, ...]) -> int:
        """Assign the tails after `parent` (which ends at token `start`) on this prompt's path, deepest
        first; how many replicas got their first depth."""
        first = 0
        for length in sorted(self._tail_lengths[parent or b""], reverse=True):
            if start + length > limit:
                continue
            holders = self._holders.get(hash_tail(parent, token_ids[start:start + length], extra, self.algorithm))
            if holders:
                first += _assign(depths, holders, start + length)
        return first


def _assign(depths: dict[str, int], holders: dict[str, int], num_tokens: int) -> int:
    """Give `num_tokens` to every holder without a deeper depth yet (deepest boundaries come first);
    how many replicas got their first depth."""
    first = 0
    for replica, tokens in holders.items():
        if tokens == num_tokens and depths.get(replica) == 0:
            depths[replica] = num_tokens
            first += 1
    return first

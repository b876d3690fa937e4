"""What a replica publishes for routing: every joint boundary (KV and GDN state at the same point)
a lookup could hit on it now, in a compact, picklable, JSON-able summary. Plain Python, no torch
and no ray, so the simulator and the Ray router read the same summaries."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from hybridserve.cache.block_pool import BlockHash, HashAlgorithm, KeyedHash

SUMMARY_FORMAT = 1  # version of the summary layout; a router refuses a summary of another version
TIERS = ("device", "host", "disk", "remote")  # fastest first; a summary stores a boundary's tier as its index here


class JointBoundary(NamedTuple):
    """One joint boundary a replica holds: `key` is its last full block's hash, or its tail hash
    when it ends inside a block; `parent` is, for a tail, the last full block's hash before it (None
    at the root) and None for a block end."""

    key: BlockHash
    parent: BlockHash | None
    num_tokens: int
    tier: str  # "device", "host", "disk", "remote"


class DecodedSummary(NamedTuple):
    """A summary read back: its epoch, block size, hash identity (None: not stated) and boundaries."""

    epoch: int
    block_size: int
    hash_id: str | None
    boundaries: list[JointBoundary]


def hash_identity(algorithm: HashAlgorithm) -> str:
    """A name for a block hash that does not reveal a seed: a router and its replicas must agree
    on it, or no key can ever match."""
    return f"{algorithm.name}:{algorithm.key_id()}" if isinstance(algorithm, KeyedHash) else algorithm


def encode_summary(boundaries: Iterable[JointBoundary], block_size: int, epoch: int,
                   hash_id: str | None = None) -> dict[str, Any]:
    """The summary a replica publishes: block ends as `[key hex, tokens, tier index]`, tails as
    `[key hex, parent hex or "", tokens, tier index]`; one row per key, its fastest tier kept."""
    best: dict[BlockHash, JointBoundary] = {}
    for boundary in boundaries:
        held = best.get(boundary.key)
        if held is None or TIERS.index(boundary.tier) < TIERS.index(held.tier):
            best[boundary.key] = boundary
    ends: list[list[Any]] = []
    tails: list[list[Any]] = []
    for boundary in best.values():
        tier = TIERS.index(boundary.tier)
        if boundary.num_tokens % block_size:
            tails.append([boundary.key.hex(), (boundary.parent or b"").hex(), boundary.num_tokens, tier])
        else:
            ends.append([boundary.key.hex(), boundary.num_tokens, tier])
    return {"format": SUMMARY_FORMAT, "epoch": int(epoch), "block_size": int(block_size), "hash": hash_id,
            "ends": ends, "tails": tails}


def decode_summary(summary: dict[str, Any]) -> DecodedSummary:
    """Read a summary `encode_summary` wrote; ValueError for another format or malformed rows."""
    if summary.get("format") != SUMMARY_FORMAT:
        raise ValueError(f"routing summary format {summary.get('format')!r}, expected {SUMMARY_FORMAT}")
    try:
        boundaries = [JointBoundary(bytes.fromhex(key), None, int(tokens), TIERS[tier])
                      for key, tokens, tier in summary["ends"]]
        boundaries += [JointBoundary(bytes.fromhex(key), bytes.fromhex(parent) if parent else None, int(tokens),
                                     TIERS[tier]) for key, parent, tokens, tier in summary["tails"]]
        return DecodedSummary(int(summary["epoch"]), int(summary["block_size"]), summary.get("hash"), boundaries)
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise ValueError(f"malformed routing summary: {error}") from None

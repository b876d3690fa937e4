"""An upper bound on the token hit rate any snapshot policy reaches with a given number of slots on a
trace (KV unbounded): the Lagrangian dual of a slot-time knapsack (docs/prefix-cache.md, Simulator).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from hybridserve.sim.trace import TraceTokens


class HitOptions(NamedTuple):
    """Every request's non-dominated hit options, flattened: option k of the trace belongs to
    request `request[k]`, saves `tokens[k]` prompt tokens and holds a slot for `stretch[k]` requests."""

    request: np.ndarray
    tokens: np.ndarray
    stretch: np.ndarray
    num_requests: int


def hit_options(tokens: TraceTokens) -> HitOptions:
    """The options the ceiling counts (`ceiling_hit_tokens`: shared hash-id prefixes and the end
    of the turn a request continues), each with its slot stretch. Call after the ceiling or a
    replay has built every request's tokens (conversation links need them)."""
    last_pass: dict[tuple[int, ...], int] = {}
    request, saved, stretch = [], [], []
    size = tokens.block_tokens
    for index, record in enumerate(tokens.records):
        cap = record.input_length - 1
        options: dict[int, int] = {}  # stretch -> most tokens saved at that stretch
        for depth in range(1, len(record.hash_ids) + 1):
            seen = last_pass.get(record.hash_ids[:depth])
            if seen is None:
                break
            _keep_best(options, index - seen, min(depth * size, cap))
        earlier = tokens.predecessor(index)
        if earlier is not None:
            previous = tokens.records[earlier]
            _keep_best(options, index - earlier, min(previous.input_length + previous.output_length - 1, cap))
        for gap, hit in options.items():
            if hit > 0:
                request.append(index)
                saved.append(hit)
                stretch.append(gap)
        for depth in range(1, len(record.hash_ids) + 1):
            last_pass[record.hash_ids[:depth]] = index
    return HitOptions(np.asarray(request, dtype=np.int64), np.asarray(saved, dtype=np.float64),
                      np.asarray(stretch, dtype=np.float64), len(tokens.records))


def _keep_best(options: dict[int, int], gap: int, hit: int) -> None:
    if hit > options.get(gap, 0):
        options[gap] = hit


def slot_bound_hit_tokens(options: HitOptions, slots: int, iterations: int = 80) -> float:
    """Most prompt tokens any policy with `slots` snapshot slots can hit (the dual bound above)."""
    if len(options.request) == 0:
        return 0.0
    capacity = float(slots) * options.num_requests

    starts = np.flatnonzero(np.r_[True, options.request[1:] != options.request[:-1]])  # grouped by request

    def dual(lam: float) -> float:
        net = np.maximum(options.tokens - lam * options.stretch, 0.0)
        return lam * capacity + float(np.maximum.reduceat(net, starts).sum())

    low, high = -12.0, math.log10(float(options.tokens.max())) + 1.0  # lam = 10**x
    for _ in range(iterations):  # golden-section search: the dual is convex in lam (and in log lam)
        a = high - (high - low) / 1.618033988749895
        b = low + (high - low) / 1.618033988749895
        if dual(10 ** a) <= dual(10 ** b):
            high = b
        else:
            low = a
    return min(dual(0.0), dual(10 ** ((low + high) / 2)))

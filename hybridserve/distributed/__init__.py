"""Tensor parallelism: weight sharding, per-rank model shapes, worker processes and collectives."""

"""Shared test helpers: tiny checkpoints, device targets, greedy runs, a live server and its
engine probes, and the prefix-cache workloads. Test modules import helpers only from here, never
from another test module."""

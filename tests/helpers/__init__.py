"""Shared test helpers: tiny checkpoints, device targets, greedy runs, a live server and its
engine probes, the prefix-cache workloads, and the default cache policy on a bare pool. Test
modules import helpers only from here, never from another test module."""

"""Benchmarks that compare hybridserve with other engines; run from the repository root."""

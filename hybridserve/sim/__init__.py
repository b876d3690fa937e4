"""Trace replay of the joint prefix cache without a model (`hybridserve sim`)."""

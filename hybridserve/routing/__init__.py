"""Routing requests across engine replicas by joint-cache hits (plain Python: no torch, no ray)."""

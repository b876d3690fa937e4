"""Engine replicas on Ray Serve behind one OpenAI-compatible endpoint, routed by joint-cache hits
(`pip install hybridserve[ray]`; docs/serving.md, "Replicas on Ray Serve", deploys `build_app` on a cluster).
Nothing here imports Ray until it is called, so single-machine use never needs it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_app"]


def build_app(*args: Any, **kwargs: Any) -> Any:
    """The Ray Serve application of N engine replicas and one ingress (`launch.build_app`)."""
    from hybridserve.replicas.launch import build_app as build

    return build(*args, **kwargs)

"""Engine replicas on Ray Serve behind one OpenAI-compatible endpoint, routed by joint-cache hits
(`pip install hybridserve[ray]`; docs/serving.md, "Replicas on Ray Serve").

On an existing Ray cluster::

    from ray import serve
    from hybridserve.config import EngineConfig
    from hybridserve.replicas import build_app

    serve.run(build_app(EngineConfig(model="path/to/model"), num_replicas=4, model_name="qwen"),
              route_prefix="/")

Nothing here imports Ray until it is called, so single-machine use never needs it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_app"]


def build_app(*args: Any, **kwargs: Any) -> Any:
    """The Ray Serve application of N engine replicas and one ingress (`launch.build_app`)."""
    from hybridserve.replicas.launch import build_app as build

    return build(*args, **kwargs)

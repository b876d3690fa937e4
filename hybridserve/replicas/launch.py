"""Building and running the replica application: `build_app` (the Ray Serve application, for
`serve.run` on an existing cluster) and `serve_replicas` (`hybridserve serve --replicas N`)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

from hybridserve import envs
from hybridserve.config import EngineConfig
from hybridserve.server.middleware import DEFAULT_MAX_BODY_BYTES

logger = logging.getLogger("hybridserve.server")

APP_NAME = "hybridserve"
ROUTERS = ("joint", "round-robin", "pow2")  # joint-cache aware; Ray's round-robin; Ray's default
INSTALL_HINT = "pip install hybridserve[ray]"
MAX_ONGOING_REQUESTS = 1024  # per replica: the engine queues and batches, Serve need not hold requests back
HEALTH_CHECK_PERIOD_S = 2.0
DEFAULT_STATS_PERIOD_S = 1.0  # how often a replica publishes its summary (Serve's routing stats period)
# a replica failing with one of these at start-up means a bad model or bad flags (exit code 2)
CONFIGURATION_ERRORS = ("ValueError", "OSError", "FileNotFoundError", "InvalidRequestError")


class ReplicaSetupError(ValueError):
    """A replica deployment that cannot work (no Ray, too few resources): one line says why."""


def import_serve() -> Any:
    """`ray.serve`, or `ReplicaSetupError` naming the extra to install."""
    try:
        from ray import serve
    except ImportError:
        raise ReplicaSetupError(f"--replicas needs Ray Serve, which is not installed: {INSTALL_HINT}") from None
    return serve


def with_shared_seed(config: EngineConfig) -> EngineConfig:
    """`config` with a block-hash seed every replica and the router share: the given one, else one
    drawn now (an xxh3_128 hash keyed per process would never match across replicas)."""
    cache = config.cache
    if cache.block_hash != "xxh3_128" or cache.block_hash_seed is not None:
        return config
    return dataclasses.replace(config, cache=dataclasses.replace(cache, block_hash_seed=secrets.randbits(64)))


def replica_resources(config: EngineConfig) -> dict[str, float]:
    """What one replica needs from Ray: a GPU per tensor-parallel rank on CUDA, else a CPU per rank."""
    device = config.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    ranks = float(config.tensor_parallel_size)
    return {"num_cpus": 1.0, "num_gpus": ranks} if device.startswith("cuda") else {"num_cpus": ranks, "num_gpus": 0.0}


def check_resources(num_replicas: int, per_replica: dict[str, float], cluster: dict[str, float]) -> None:
    """`ReplicaSetupError` when the cluster's CPUs or GPUs cannot hold `num_replicas` replicas."""
    if num_replicas < 1:
        raise ReplicaSetupError(f"--replicas must be >= 1, got {num_replicas}")
    for key, resource in (("num_cpus", "CPU"), ("num_gpus", "GPU")):
        need = num_replicas * per_replica.get(key, 0.0)
        have = float(cluster.get(resource, 0.0))
        if need > have:
            raise ReplicaSetupError(f"{num_replicas} replicas need {need:g} {resource}s ({per_replica[key]:g} "
                                    f"each); the Ray cluster has {have:g}")


def _router_config(name: str, config: EngineConfig, stats_period_s: float,
                   router_config: dict[str, Any] | None) -> Any:
    from ray.serve.config import RequestRouterConfig

    options: dict[str, Any] = {"request_routing_stats_period_s": stats_period_s,
                               "request_routing_stats_timeout_s": max(10.0, 5 * stats_period_s)}
    if name == "round-robin":  # classes by import path: Serve imports them where the handle lives
        options["request_router_class"] = "ray.serve.experimental.round_robin_router.RoundRobinRouter"
    elif name == "joint":
        options["request_router_class"] = "hybridserve.replicas.router.JointCacheRouter"
        options["request_router_kwargs"] = {
            "block_size": config.cache.block_size, "block_hash": config.cache.block_hash,
            "block_hash_seed": config.cache.block_hash_seed, "router_config": dict(router_config or {})}
    elif name != "pow2":
        raise ReplicaSetupError(f"unknown router {name!r} (known: {', '.join(ROUTERS)})")
    return RequestRouterConfig(**options)


def build_app(config: EngineConfig, *, num_replicas: int, model_name: str | Sequence[str],
              api_keys: Sequence[str] = (), reasoning_parser: str | None = None, stream_interval: int = 1,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, engine_process: bool = False,
              max_waiting_requests: int | None = None, router: str = "joint",
              router_config: dict[str, Any] | None = None, stats_period_s: float = DEFAULT_STATS_PERIOD_S,
              dev_mode: bool | None = None) -> Any:
    """The Ray Serve application of `num_replicas` engine replicas behind one ingress (docs/serving.md, Replicas
    on Ray Serve). `router`: one of ROUTERS ("joint": `router_config` holds `RouterConfig` fields); `dev_mode`
    serves the operator endpoints (None: as HYBRIDSERVE_SERVER_DEV_MODE says here, in the driver); the other
    options are `hybridserve serve`'s flags of the same names."""
    serve = import_serve()
    from hybridserve.replicas.ingress import Ingress
    from hybridserve.replicas.replica import EngineReplica

    config = with_shared_seed(config)
    resources = replica_resources(config)
    if resources["num_gpus"] == 0 and config.num_threads is None:  # one core per rank, not every core
        config = dataclasses.replace(config, num_threads=max(1, int(resources["num_cpus"])))
    engines = serve.deployment(
        EngineReplica, name="engine", num_replicas=num_replicas, max_ongoing_requests=MAX_ONGOING_REQUESTS,
        ray_actor_options=resources, health_check_period_s=HEALTH_CHECK_PERIOD_S,
        request_router_config=_router_config(router, config, stats_period_s, router_config))
    ingress = serve.deployment(Ingress, name="ingress", num_replicas=1, max_ongoing_requests=MAX_ONGOING_REQUESTS,
                               ray_actor_options={"num_cpus": 0})
    app_options = {"model_name": model_name, "api_keys": list(api_keys), "reasoning_parser": reasoning_parser,
                   "stream_interval": stream_interval, "max_body_bytes": max_body_bytes,
                   "dev_mode": envs.server_dev_mode() if dev_mode is None else dev_mode}
    return ingress.bind(engines.bind(config, engine_process, max_waiting_requests), app_options)


def serve_replicas(args: argparse.Namespace) -> int:
    """`hybridserve serve --replicas N`: start (or join, with RAY_ADDRESS) a Ray instance, deploy,
    serve on --host/--port until interrupted. Exit code 2 for a bad configuration (one error line),
    1 when the port cannot be bound or the replicas do not start."""
    from hybridserve.engine_args import engine_config_from_args
    from hybridserve.server.cli import api_keys_from, bind_socket, check_http_arguments, served_model_names

    try:
        config = engine_config_from_args(args)
        names = served_model_names(args)
        api_keys = api_keys_from(args)
        check_http_arguments(args)
        if args.root_path:
            raise ReplicaSetupError("--root-path is not supported with --replicas")
        serve = import_serve()
    except ValueError as exc:
        logger.error("cannot start: %s", exc)
        return 2
    try:
        bind_socket(args.host, args.port).close()  # Serve's proxy binds it; a taken port fails here, clearly
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", args.host, args.port, exc.strerror or exc)
        return 1
    import ray

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False,
                 logging_level=logging.WARNING, log_to_driver=args.log_level == "debug")
    try:
        cluster: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
        check_resources(args.replicas, replica_resources(config), cluster)
        app = build_app(config, num_replicas=args.replicas, model_name=names, api_keys=api_keys,
                        reasoning_parser=args.reasoning_parser, stream_interval=args.stream_interval,
                        max_body_bytes=args.max_body_bytes, engine_process=args.engine_process == "on",
                        max_waiting_requests=args.max_waiting_requests)
    except ValueError as exc:
        logger.error("cannot start: %s", exc)
        _stop_ray(started_ray)
        return 2
    return _run_until_stopped(serve, app, args, names, started_ray)


def _run_until_stopped(serve: Any, app: Any, args: argparse.Namespace, names: list[str], started_ray: bool) -> int:
    from hybridserve.server.cli import raise_system_exit

    if threading.current_thread() is threading.main_thread():  # also during start-up: Ray's own handler
        signal.signal(signal.SIGTERM, raise_system_exit)        # would end the process without cleaning up
    try:
        try:
            serve.start(http_options={"host": args.host, "port": args.port})
            serve.run(app, name=APP_NAME, route_prefix="/")
        except Exception as exc:  # a replica that cannot start: the engine's own error, as Serve recorded it
            reason = (failed_deployment_reason(serve) or str(exc).strip() or type(exc).__name__).splitlines()[-1]
            logger.error("cannot start the replicas: %s", reason)
            return 2 if reason.startswith(CONFIGURATION_ERRORS) else 1  # as `serve` without replicas
        logger.info("serving %s on http://%s:%d with %d engine replica(s) on Ray Serve", ", ".join(names),
                    args.host, args.port, args.replicas)
        while True:
            time.sleep(1.0)
    except (KeyboardInterrupt, SystemExit):
        return 0
    finally:
        _stop_serve(serve, started_ray)
        logger.info("replicas stopped")


def failed_deployment_reason(serve: Any) -> str | None:
    """The last line of the error a failed deployment of the app recorded (its replica's
    exception, e.g. the engine's memory plan refusing the flags), or None."""
    try:
        application = serve.status().applications.get(APP_NAME)
    except Exception:  # the status only makes a better message; the caller has one already
        return None
    if application is None:
        return None
    for deployment in application.deployments.values():
        lines = [line for line in str(deployment.message).splitlines() if line.strip()]
        if str(deployment.status).endswith("DEPLOY_FAILED") and lines:
            return lines[-1].strip()
    return None


def _stop_serve(serve: Any, started_ray: bool) -> None:
    serve.delete(APP_NAME)
    if started_ray:
        serve.shutdown()
    _stop_ray(started_ray)


def _stop_ray(started_ray: bool) -> None:
    if started_ray:
        import ray

        ray.shutdown()

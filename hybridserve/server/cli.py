"""`hybridserve serve [MODEL]`: the flags (`add_serve_arguments`) and the runner (`run_server`),
which binds the port, starts the engine and serves with uvicorn; a start-up failure is one error
line and a non-zero exit."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import threading
from pathlib import Path
from typing import Any

from hybridserve import envs
from hybridserve.engine_args import (
    add_engine_arguments,
    engine_config_from_args,
    model_from_args,
)
from hybridserve.sampling_params import MAX_STREAM_INTERVAL
from hybridserve.server.app import DEFAULT_MAX_BODY_BYTES
from hybridserve.server.auth import read_key_file
from hybridserve.server.reasoning_parser import REASONING_PARSERS

logger = logging.getLogger("hybridserve.server")

API_KEY_ENV = envs.API_KEY.name
BUILTIN_MODEL_NAME = "hybridserve-builtin"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `serve` flags (engine flags with a positional model, plus the HTTP ones) to `parser`."""
    add_engine_arguments(parser, model_positional=True)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=8000, help="port to bind")
    parser.add_argument("--api-key", action="append", default=None,
                        help=f"require 'Authorization: Bearer KEY' on every route but /health and /ready; repeat "
                             f"for several tenants (each key's requests get their own prefix-cache salt and "
                             f"in-flight cap); visible in the process list, so prefer --api-key-file or "
                             f"${API_KEY_ENV}, which is read when neither flag is given")
    parser.add_argument("--api-key-file", default=None,
                        help="file with one API key per line (added to --api-key); it must not be accessible "
                             "to group or others (chmod 600)")
    parser.add_argument("--root-path", default="",
                        help="path prefix a reverse proxy serves the API under (ASGI root_path, e.g. /llm)")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="model name(s) in the API (aliases; the first is reported); when unset, the model "
                             "directory's name")
    parser.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                        help="move the model's thinking into reasoning_content")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest accepted request body; larger ones get 413")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="streamed responses send the first token, then one chunk per this many new tokens "
                             "(fewer, larger chunks: less work per token for the server and its clients)")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="log level")
    parser.add_argument("--engine-process", default="on", choices=("on", "off"),
                        help="on: run the engine core in its own process (API process: HTTP, JSON, SSE); "
                             "off: run it on a thread of the API process")
    parser.add_argument("--replicas", type=int, default=None, metavar="N",
                        help="run N engine replicas on Ray Serve (a local instance, or the cluster at "
                             "$RAY_ADDRESS) behind this endpoint, routed by joint-cache hits; needs "
                             "`pip install hybridserve[ray]` (docs/serving.md, Replicas on Ray Serve)")


def build_parser() -> argparse.ArgumentParser:
    """A standalone parser for `python -m hybridserve.server.cli`."""
    parser = argparse.ArgumentParser(prog="hybridserve serve", description="Serve the OpenAI-compatible API.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_arguments(parser)
    return parser


def served_model_names(args: argparse.Namespace) -> list[str]:
    """`--served-model-name`, else a Hub id as given (`org/name`, as vLLM serves it), else the model
    directory's name, else the built-in model's name."""
    if args.served_model_name:
        return list(args.served_model_name)
    model = model_from_args(args)
    if model and not Path(model).expanduser().is_dir() and model.count("/") == 1 \
            and not model.startswith(("/", ".", "~")):
        return [model]
    return [Path(model).resolve().name] if model else [BUILTIN_MODEL_NAME]


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (OSError when the port is taken). It names IPPROTO_TCP: asyncio
    turns Nagle's algorithm off only on sockets that do, else keep-alive responses wait for ACKs."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets on Linux
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def api_keys_from(args: argparse.Namespace) -> list[str]:
    """Keys from `--api-key` (repeatable) and `--api-key-file`; else ${HYBRIDSERVE_API_KEY}."""
    keys = list(args.api_key or [])
    if getattr(args, "api_key_file", None):
        keys += read_key_file(args.api_key_file)
    env_key = envs.api_key()
    if not keys and env_key:
        keys.append(env_key)
    return keys


def raise_system_exit(signum: int, _frame: object) -> None:
    """The SIGTERM handler: uvicorn re-raises the signal it stopped on, and unwinding (instead of
    dying) lets the engine shut down cleanly."""
    raise SystemExit(128 + signum)


def check_http_arguments(args: argparse.Namespace) -> None:
    """`ValueError` for HTTP flags out of range, before any engine is built."""
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if args.root_path and (not args.root_path.startswith("/") or args.root_path.endswith("/")):
        raise ValueError(f"--root-path must start with '/' and not end with one, got {args.root_path!r}")
    if not 1 <= args.stream_interval <= MAX_STREAM_INTERVAL:
        raise ValueError(f"--stream-interval must be in [1, {MAX_STREAM_INTERVAL}], got {args.stream_interval}")


def run_server(args: argparse.Namespace) -> int:
    """Bind, start the engine and serve until interrupted; the exit code is 0 after a clean
    shutdown, 1 when the port cannot be bound or the engine not started, 2 for a bad configuration."""
    import uvicorn

    from hybridserve.engine.memory import freeze_startup_heap
    from hybridserve.server.app import build_app

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(args.log_level.upper())  # also when the caller configured logging already
    if getattr(args, "replicas", None) is not None:  # N engines on Ray Serve behind this endpoint
        from hybridserve.replicas.launch import serve_replicas

        return serve_replicas(args)
    try:
        config = engine_config_from_args(args)
        names = served_model_names(args)
        api_keys = api_keys_from(args)
        check_http_arguments(args)
    except ValueError as exc:
        logger.error("cannot start: %s", exc)
        return 2
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", args.host, args.port, exc.strerror or exc)
        return 1
    try:
        async_engine, stats = start_engine(config, args.engine_process == "on", args.max_waiting_requests)
    except (ValueError, OSError) as exc:
        sock.close()
        logger.error("cannot load the model: %s", exc)
        return 2
    except (RuntimeError, TimeoutError) as exc:
        sock.close()
        logger.error("cannot start the engine: %s", exc)
        return 1
    logger.info("KV cache: %d blocks (%d free); GDN state slots: %d; snapshot slots: %d of %d bytes each; "
                "max model length: %d tokens", stats.get("kv_blocks_total", 0), stats.get("kv_blocks_free", 0),
                stats.get("state_slots_total", 0), stats.get("snapshot_slots_total", 0),
                stats.get("bytes_per_snapshot", 0), async_engine.max_model_len)
    app = build_app(async_engine, model_name=names, api_keys=api_keys, max_body_bytes=args.max_body_bytes,
                    reasoning_parser=args.reasoning_parser, stream_interval=args.stream_interval)
    logger.info("serving %s on http://%s:%d (auth %s, engine %s)", ", ".join(names), args.host, args.port,
                f"on, {len(api_keys)} key(s), per-key cache salt" if api_keys else "off",
                "core process" if args.engine_process == "on" else "thread")
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, raise_system_exit)
    # The access log is the app's own (hybridserve.access: with request ids), not uvicorn's.
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, lifespan="off", access_log=False,
                                           root_path=args.root_path))
    freeze_startup_heap()  # this process serves from here on (with the engine too, unless it has a process)
    try:  # the engine's lifetime is managed here, so uvicorn's lifespan protocol is not needed
        serve_uvicorn(server, [sock], async_engine)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        async_engine.shutdown()
        sock.close()
        logger.info("engine stopped")
    return 0


def serve_uvicorn(server: Any, sockets: list[socket.socket], engine: Any) -> None:
    """Run a uvicorn `server` on `sockets`; an engine core client reads the core's outputs on its
    event loop (`read_on_loop`), so one thread of this process wakes per engine step."""

    async def serve() -> None:
        read_on_loop = getattr(engine, "read_on_loop", None)
        if read_on_loop is not None:
            read_on_loop(asyncio.get_running_loop())
        await server.serve(sockets=sockets)

    loop_factory = getattr(server.config, "get_loop_factory", None)
    if loop_factory is None:  # older uvicorn sets an event loop policy instead
        server.config.setup_event_loop()
        asyncio.run(serve())
        return
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(serve())


def start_engine(config: Any, engine_process: bool, max_waiting_requests: int | None) -> tuple[Any, dict[str, float]]:
    """A started engine front end (an engine core process, or the engine on a thread) and its start-up
    stats; ValueError/OSError for a bad model or configuration."""
    if engine_process:
        from hybridserve.engine.core_client import EngineCoreClient

        client = EngineCoreClient(config, max_waiting_requests=max_waiting_requests)
        client.start()
        return client, client.startup_stats
    from hybridserve.engine.async_engine import AsyncLLMEngine
    from hybridserve.engine.engine import LLMEngine

    engine = LLMEngine(config)
    stats = engine.stats()  # the engine thread has not started yet
    async_engine = AsyncLLMEngine(engine, max_waiting_requests=max_waiting_requests)
    async_engine.start()
    return async_engine, stats


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m hybridserve.server.cli`."""
    return run_server(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

"""`hybridserve bench ...`: subcommands that print a table and optionally write JSON.

Flags are the engine flags plus the fields of each subcommand's settings dataclass (`bench.configs`);
building the parser imports no torch. Developer harnesses live in `benchmarks/`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import Any, TypeAlias

from hybridserve.bench import configs
from hybridserve.engine_args import add_engine_arguments

Handler = Callable[[argparse.Namespace], int]

# name -> settings dataclass (its docstring is the subcommand's help); module bench/<name>_bench.py
# has run_<name>_bench(engine_config, settings) and format_<name>_report(result)
ENGINE_BENCHES: dict[str, type] = {
    "engine": configs.EngineBenchConfig, "decode": configs.DecodeBenchConfig, "ttft": configs.TTFTBenchConfig,
    "trace": configs.TraceBenchConfig, "chat": configs.ChatBenchConfig, "structured": configs.StructuredBenchConfig,
    "tp": configs.TPBenchConfig,
}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every `hybridserve bench` subcommand."""
    names = [*ENGINE_BENCHES, "serve", "all"]
    subparsers = parser.add_subparsers(dest="bench_command", required=True, metavar="{" + ",".join(names) + "}")
    for name, config_cls in ENGINE_BENCHES.items():
        sub = _subparser(subparsers, name, " ".join((config_cls.__doc__ or "").split()), _run_engine_bench, config_cls)
        if name == "ttft":
            sub.add_argument("--plot", metavar="PATH", default=None, help="save a bar chart (needs matplotlib)")
    serve_parser = _subparser(subparsers, "serve", "load test of a live OpenAI-compatible server: TTFT, ITL, "
                              "throughput, cache share, mixed load", run_serve, configs.ServeBenchConfig)
    serve_parser.add_argument("--url", default=None, help="benchmark this running server (engine flags then unused)")
    serve_parser.add_argument("--api-key", default=None, help="bearer key for the server")
    serve_parser.add_argument("--compare-offline", action="store_true",
                              help="compare the server with LLM.generate on the same requests (decode ms/token, "
                                   "warm TTFT, 16-stream tok/s) instead of the load test")
    configs.add_config_arguments(serve_parser, configs.CompareConfig)
    all_parser = _subparser(subparsers, "all", "bench engine, then bench ttft (and bench trace with --with-trace), "
                            "each with its default sizes", run_all)
    all_parser.add_argument("--with-trace", action="store_true", help="also replay the trace (several minutes)")
    all_parser.add_argument("--plot", metavar="PATH", default=None, help="save the ttft bar chart (needs matplotlib)")


Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"  # not subscriptable at run time


def _subparser(subparsers: Subparsers, name: str, help_text: str, handler: Handler,
               config_cls: type | None = None) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(name, help=help_text, description=help_text,
                                                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_arguments(parser)
    if config_cls is not None:
        configs.add_config_arguments(parser, config_cls)
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the figures as JSON here")
    parser.set_defaults(handler=handler, config_cls=config_cls)
    return parser


def _finish(args: argparse.Namespace, result: dict[str, Any], report: str) -> int:
    from hybridserve.bench.common import write_json

    if report:
        print(report, flush=True)
    if args.json:
        write_json(args.json, result)
        print(f"[bench] figures written to {args.json}", file=sys.stderr)
    return 0


def _run_bench(name: str, engine_config: Any, cfg: Any, plot_path: str | None, heading: str = "") -> dict[str, Any]:
    """Run one of `ENGINE_BENCHES`, print its report (and save the ttft plot when asked); its figures."""
    module = importlib.import_module(f"hybridserve.bench.{name}_bench")
    result: dict[str, Any] = getattr(module, f"run_{name}_bench")(engine_config, cfg)
    print(heading + getattr(module, f"format_{name}_report")(result), flush=True)
    if name == "ttft" and plot_path:
        try:
            module.plot_ttft(result, plot_path)
            print(f"[bench] plot written to {plot_path}", file=sys.stderr)
        except ImportError:
            print("[bench] --plot needs matplotlib (pip install 'hybridserve[bench]')", file=sys.stderr)
    return result


def _run_engine_bench(args: argparse.Namespace) -> int:
    """Handler of the benchmarks that drive an in-process engine (`ENGINE_BENCHES`)."""
    from hybridserve.engine_args import engine_config_from_args

    cfg = configs.config_from_args(args.config_cls, args)
    result = _run_bench(args.bench_command, engine_config_from_args(args), cfg, getattr(args, "plot", None))
    return _finish(args, result, "")


def serve_args_from(args: argparse.Namespace) -> list[str]:
    """`hybridserve serve` arguments for the engine flags that differ from their defaults."""
    probe = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(probe)
    argv = [args.model] if getattr(args, "model", None) else []
    for action in probe._actions:
        if not action.option_strings or action.dest == "model":
            continue
        value = getattr(args, action.dest, action.default)
        if value is not None and value != action.default:
            argv += [action.option_strings[0], str(value)]
    return argv


def run_serve(args: argparse.Namespace) -> int:
    """Handler of `bench serve` (`--compare-offline`: the server against `LLM.generate`)."""
    if args.compare_offline:
        from hybridserve.bench.serve_compare import format_compare_report, run_compare
        from hybridserve.engine_args import engine_config_from_args

        cfg = configs.config_from_args(configs.CompareConfig, args, seed=args.bench_seed)
        result = run_compare(cfg, engine_config_from_args(args), serve_args_from(args))
        return _finish(args, result, format_compare_report(result))
    from hybridserve.bench.serve_bench import format_serve_report, run_serve_bench

    result = run_serve_bench(configs.config_from_args(configs.ServeBenchConfig, args), url=args.url,
                             serve_args=serve_args_from(args), api_key=args.api_key)
    return _finish(args, result, format_serve_report(result))


def run_all(args: argparse.Namespace) -> int:
    """Handler of `bench all`: the other benchmarks in turn, default sizes, one combined JSON."""
    from hybridserve.engine_args import engine_config_from_args

    config = engine_config_from_args(args)
    results: dict[str, Any] = {}
    for name in ("engine", "ttft", "trace") if args.with_trace else ("engine", "ttft"):
        cfg = configs.TraceBenchConfig(progress=False) if name == "trace" else ENGINE_BENCHES[name]()
        heading = ("\n" if results else "") + f"== bench {name} ==\n"
        results[name] = _run_bench(name, config, cfg, args.plot, heading)
    return _finish(args, results, "")

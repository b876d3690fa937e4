"""`hybridserve bench {engine,decode,ttft,trace,chat,serve,structured,soak,threads,tp,peer,all}`: subcommands that print
a table and optionally write JSON."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from hybridserve.bench.serve_bench import add_serve_bench_arguments, run_serve
from hybridserve.engine_args import add_engine_arguments, engine_config_from_args

Handler = Callable[[argparse.Namespace], int]


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `engine`, `ttft`, `trace`, `serve`, `structured` and `all` benchmark subcommands."""
    subparsers = parser.add_subparsers(dest="bench_command", required=True,
                                       metavar="{engine,decode,ttft,trace,chat,serve,structured,soak,threads,tp,peer,all}")
    _add_engine(subparsers)
    _add_decode(subparsers)
    _add_ttft(subparsers)
    _add_trace(subparsers)
    _add_chat(subparsers)
    add_serve_bench_arguments(_subparser(subparsers, "serve", "load test of a live OpenAI-compatible server: "
                                         "TTFT, ITL, throughput, cache share, mixed load", run_serve))
    _add_structured(subparsers)
    _add_soak(subparsers)
    _add_threads(subparsers)
    _add_tp(subparsers)
    _add_peer(subparsers)
    _add_all(subparsers)


def _subparser(subparsers: argparse._SubParsersAction, name: str, help_text: str,
               handler: Handler) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(name, help=help_text, description=help_text,
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_arguments(parser)
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the figures as JSON here")
    parser.set_defaults(handler=handler)
    return parser


def _add_engine(subparsers: argparse._SubParsersAction) -> None:
    parser = _subparser(subparsers, "engine", "hybridserve vs transformers (same weights): prefill, "
                        "decode, batching, FLOP rate", run_engine)
    parser.add_argument("--prompt-tokens", type=int, default=4160, help="cold prefill prompt length")
    parser.add_argument("--decode-prompt-tokens", type=int, default=32, help="prompt length before decoding")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per decode run")
    parser.add_argument("--batch-size", type=int, default=16, help="batch of the aggregate decode measure")
    parser.add_argument("--warmup", type=int, default=1, help="discarded iterations")
    parser.add_argument("--iterations", type=int, default=5, help="measured iterations")
    parser.add_argument("--matmul-size", type=int, default=2048, help="side of the matmul that sets the peak")
    parser.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts")


def _add_decode(subparsers: argparse._SubParsersAction) -> None:
    parser = _subparser(subparsers, "decode", "batch-1 decode vs the time to read the weights once, for "
                        "float32, bfloat16 and int8 weights side by side, and their quality against float32",
                        run_decode)
    parser.add_argument("--variants", nargs="+", default=["float32", "bfloat16", "int8"],
                        choices=["float32", "bfloat16", "int8"], help="weight formats to compare")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length before decoding")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded per measured request")
    parser.add_argument("--quality-prompts", type=int, default=4, help="prompts of the quality comparison")
    parser.add_argument("--greedy-tokens", type=int, default=64, help="greedy tokens compared per prompt")
    parser.add_argument("--warmup", type=int, default=1, help="discarded rounds")
    parser.add_argument("--iterations", type=int, default=5, help="measured rounds")
    parser.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts")


def _add_ttft(subparsers: argparse._SubParsersAction) -> None:
    parser = _subparser(subparsers, "ttft", "TTFT with the joint prefix cache off vs on, floor, "
                        "no-reuse throughput", run_ttft)
    parser.add_argument("--cached-tokens", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096],
                        help="cached prefix lengths (one row each)")
    parser.add_argument("--suffix-tokens", type=int, default=64, help="fresh tokens after the cached prefix")
    parser.add_argument("--warmup", type=int, default=1, help="extra warm-hit runs per row, discarded")
    parser.add_argument("--iterations", type=int, default=9, help="measured iterations per row")
    parser.add_argument("--throughput-requests", type=int, default=16, help="requests of the no-reuse workload")
    parser.add_argument("--throughput-prompt-tokens", type=int, default=512, help="prompt length there")
    parser.add_argument("--throughput-output-tokens", type=int, default=32, help="output tokens there")
    parser.add_argument("--throughput-rounds", type=int, default=1, help="ABBA rounds (4 runs each)")
    parser.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--plot", metavar="PATH", default=None, help="save a bar chart (needs matplotlib)")


def _add_trace(subparsers: argparse._SubParsersAction) -> None:
    parser = _subparser(subparsers, "trace", "scaled replay of the Mooncake conversation trace, cache on "
                        "vs off", run_trace)
    parser.add_argument("--trace", default="", help="trace JSONL (default: ../shared/traces/"
                        "mooncake_conversation.jsonl next to the repository)")
    parser.add_argument("--num-requests", type=int, default=800, help="replay the first N requests")
    parser.add_argument("--block-tokens", type=int, default=16, help="tokens per 512-token trace block")
    parser.add_argument("--max-output-tokens", type=int, default=8, help="cap on output tokens")
    parser.add_argument("--max-concurrency", type=int, default=1, help="requests in the engine at once")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_chat(subparsers: argparse._SubParsersAction) -> None:
    parser = _subparser(subparsers, "chat", "interleaved multi-turn conversations, TTFT per turn with the "
                        "cache on vs off", run_chat)
    parser.add_argument("--conversations", type=int, default=4, help="conversations played round-robin")
    parser.add_argument("--turns", type=int, default=8, help="turns per conversation")
    parser.add_argument("--system-tokens", type=int, default=1024, help="system prompt length")
    parser.add_argument("--message-tokens", type=int, default=160, help="new user tokens per turn")
    parser.add_argument("--reply-tokens", type=int, default=48, help="generated tokens per turn")
    parser.add_argument("--bench-seed", type=int, default=0, help="seed of the random messages")


def _add_soak(subparsers: argparse._SubParsersAction) -> None:
    parser = _subparser(subparsers, "soak", "mixed random traffic against a live server for a fixed time: "
                        "errors by class, leaks, RSS curve, latency percentiles", run_soak)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of traffic")
    parser.add_argument("--clients", type=int, default=6, help="concurrent clients")
    parser.add_argument("--overload-every", type=float, default=45.0, help="seconds between overload bursts")
    parser.add_argument("--overload-burst", type=int, default=40, help="requests sent at once in a burst")
    parser.add_argument("--rss-window", type=float, default=60.0,
                        help="RSS growth compares the mean of the last window with the second one")
    parser.add_argument("--url", default=None, help="soak a running server instead of starting one")
    parser.add_argument("--plot", metavar="PATH", default=None, help="save the RSS curve (matplotlib)")
    parser.add_argument("--bench-seed", type=int, default=0, help="seed of the traffic")
    # A small queue, so the overload bursts do overflow it.
    parser.set_defaults(max_num_seqs=4, max_waiting_requests=8, max_model_len=4096, kv_cache_mib=64.0,
                        prefix_cache_mib=64.0)


def _add_threads(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("threads", help="decode ms/token idle vs with one core kept busy, per thread "
                                   "setting", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="idle/busy pairs per setting (median)")
    parser.add_argument("--decode-tokens", type=int, default=48, help="tokens decoded per run")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the figures as JSON here")
    parser.set_defaults(handler=run_threads)


def _add_tp(subparsers: argparse._SubParsersAction) -> None:
    parser = _subparser(subparsers, "tp", "prefill and decode at TP=1 (1 and 2 threads) vs TP=2 (1 thread per "
                        "rank), with the all-reduce and transport shares of a step", run_tp)
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="cold prefill prompt length")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded per run")
    parser.add_argument("--iterations", type=int, default=3, help="measured iterations (alternating order)")
    parser.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts")


def run_tp(args: argparse.Namespace) -> int:
    """Handler of `bench tp`."""
    from hybridserve.bench.tp_bench import TPBenchConfig, format_tp_report, run_tp_bench

    cfg = TPBenchConfig(args.prompt_tokens, args.decode_tokens, args.iterations, args.bench_seed)
    result = run_tp_bench(engine_config_from_args(args), cfg)
    return _finish(args, result, format_tp_report(result))


def _add_peer(subparsers: argparse._SubParsersAction) -> None:
    help_text = ("hybridserve vs llama.cpp (llama-cpp-python's server) on the same weights, alternating: "
                 "cold/warm TTFT, batch-1 decode, and in-process batch-16 scaling (needs the `peer` extra)")
    parser = subparsers.add_parser("peer", help=help_text, description=help_text,
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=None, help="Hugging Face model dir (the built-in model when omitted)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "int8"),
                        help="hybridserve --dtype float32 / bfloat16 / --quantization int8 against a GGUF "
                             "of f32 / bf16 / q8_0")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of each server")
    parser.add_argument("--iterations", type=int, default=5, help="measured rounds (alternating order)")
    parser.add_argument("--warmup", type=int, default=1, help="discarded rounds")
    parser.add_argument("--prompt-tokens", type=int, default=4160, help="cold and warm prompt length")
    parser.add_argument("--shared-tokens", type=int, default=4096, help="prefix the warm prompt shares")
    parser.add_argument("--extend-tokens", type=int, default=64, help="tokens the extension adds")
    parser.add_argument("--decode-tokens", type=int, default=128, help="tokens streamed per decode run")
    parser.add_argument("--agreement-tokens", type=int, default=32, help="greedy tokens compared in-process")
    parser.add_argument("--n-ctx", type=int, default=8192, help="llama.cpp context size")
    parser.add_argument("--n-batch", type=int, default=512, help="llama.cpp batch size (llama_cpp.server default)")
    parser.add_argument("--work-dir", default="", help="where the model dir and GGUF files are kept "
                        "(default: <tmp>/hybridserve-peer)")
    parser.add_argument("--rebuild-gguf", action="store_true", help="write the GGUF file even if present")
    parser.add_argument("--llama-cpp-extra-bufts", default="auto", choices=("auto", "on", "off"),
                        help="llama.cpp's extra weight buffer types (AMX, repacked layouts); auto: on, "
                             "and off if llama.cpp crashes with them (q8_0 on an AMX CPU)")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="sequences of the in-process batch-scaling measurement (0: skip it)")
    parser.add_argument("--batch-iterations", type=int, default=3, help="alternations of batch 1 and the batch")
    parser.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the figures as JSON here")
    parser.set_defaults(handler=run_peer)


def run_peer(args: argparse.Namespace) -> int:
    """Handler of `bench peer`: exit status 2 with a message when a requirement is missing."""
    from hybridserve.bench.peer_bench import (
        PeerBenchConfig,
        PeerCrashed,
        format_peer_report,
        run_peer_bench,
    )

    cfg = PeerBenchConfig(dtype=args.dtype, threads=args.threads, prompt_tokens=args.prompt_tokens,
                          shared_tokens=args.shared_tokens, extend_tokens=args.extend_tokens,
                          decode_tokens=args.decode_tokens, iterations=args.iterations, warmup=args.warmup,
                          agreement_tokens=args.agreement_tokens, n_ctx=args.n_ctx, n_batch=args.n_batch,
                          model=args.model, work_dir=args.work_dir, rebuild_gguf=args.rebuild_gguf,
                          seed=args.bench_seed, llama_cpp_extra_bufts=args.llama_cpp_extra_bufts,
                          batch_size=args.batch_size, batch_iterations=args.batch_iterations)
    try:
        result = run_peer_bench(cfg, log=lambda line: print(line, file=sys.stderr, flush=True))
    except RuntimeError as exc:
        if "needs" not in str(exc) and not isinstance(exc, PeerCrashed):
            raise
        print(f"[bench] {exc}", file=sys.stderr)
        return 2
    return _finish(args, result, format_peer_report(result))


def run_soak(args: argparse.Namespace) -> int:
    """Handler of `bench soak`: exit status 1 when the soak's pass criteria fail."""
    from hybridserve.bench.serve_bench import serve_args_from
    from hybridserve.bench.soak_bench import SoakConfig, format_soak_report, plot_rss
    from hybridserve.bench.soak_bench import run_soak as soak

    cfg = SoakConfig(duration_s=args.duration, clients=args.clients, overload_every_s=args.overload_every,
                     overload_burst=args.overload_burst, rss_window_s=args.rss_window, seed=args.bench_seed)
    result = soak(cfg, url=args.url, serve_args=serve_args_from(args))
    _finish(args, result, format_soak_report(result))
    if args.plot and result["rss"]:
        plot_rss(result, args.plot)
        print(f"[bench] RSS plot written to {args.plot}", file=sys.stderr)
    return 0 if result["passed"] else 1


def run_threads(args: argparse.Namespace) -> int:
    """Handler of `bench threads`."""
    from hybridserve.bench.threads_bench import format_threads_report, run_threads_bench

    result = run_threads_bench(decode_tokens=args.decode_tokens, rounds=args.rounds)
    return _finish(args, result, format_threads_report(result))


def _add_structured(subparsers: argparse._SubParsersAction) -> None:
    parser = _subparser(subparsers, "structured", "decode step time with a JSON schema active vs "
                        "unconstrained, batch 1 and 16", run_structured)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16], help="one row each")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="prompt length before decoding")
    parser.add_argument("--decode-tokens", type=int, default=48, help="tokens generated per run")
    parser.add_argument("--warmup", type=int, default=1, help="discarded iterations")
    parser.add_argument("--iterations", type=int, default=4, help="measured iterations (alternating order)")
    parser.add_argument("--bench-seed", type=int, default=0, help="seed of prompts and sampling")


def _add_all(subparsers: argparse._SubParsersAction) -> None:
    parser = _subparser(subparsers, "all", "bench engine, then bench ttft (and bench trace with --with-trace), "
                        "each with its default sizes", run_all)
    parser.add_argument("--with-trace", action="store_true", help="also replay the trace (several minutes)")
    parser.add_argument("--plot", metavar="PATH", default=None, help="save the ttft bar chart (needs matplotlib)")


def _set_threads(args: argparse.Namespace) -> None:
    from hybridserve.engine.threads import configure_threads

    configure_threads(args.threads)


def _finish(args: argparse.Namespace, result: dict[str, Any], report: str) -> int:
    from hybridserve.bench.common import write_json

    if report:
        print(report)
    if args.json:
        write_json(args.json, result)
        print(f"[bench] figures written to {args.json}", file=sys.stderr)
    return 0


def run_engine(args: argparse.Namespace) -> int:
    """Handler of `bench engine`."""
    from hybridserve.bench.engine_bench import (
        EngineBenchConfig,
        format_engine_report,
        run_engine_bench,
    )

    cfg = EngineBenchConfig(prompt_tokens=args.prompt_tokens, decode_prompt_tokens=args.decode_prompt_tokens,
                            decode_tokens=args.decode_tokens, batch_size=args.batch_size, warmup=args.warmup,
                            iterations=args.iterations, matmul_size=args.matmul_size, seed=args.bench_seed)
    _set_threads(args)
    result = run_engine_bench(engine_config_from_args(args), cfg)
    return _finish(args, result, format_engine_report(result))


def run_decode(args: argparse.Namespace) -> int:
    """Handler of `bench decode`."""
    from hybridserve.bench.decode_bench import (
        DecodeBenchConfig,
        format_decode_report,
        run_decode_bench,
    )

    cfg = DecodeBenchConfig(variants=tuple(args.variants), prompt_tokens=args.prompt_tokens,
                            decode_tokens=args.decode_tokens, quality_prompts=args.quality_prompts,
                            greedy_tokens=args.greedy_tokens, warmup=args.warmup, iterations=args.iterations,
                            seed=args.bench_seed)
    _set_threads(args)
    result = run_decode_bench(engine_config_from_args(args), cfg)
    return _finish(args, result, format_decode_report(result))


def run_ttft(args: argparse.Namespace) -> int:
    """Handler of `bench ttft`."""
    from hybridserve.bench.ttft_bench import (
        TTFTBenchConfig,
        format_ttft_report,
        plot_ttft,
        run_ttft_bench,
    )

    cfg = TTFTBenchConfig(cached_tokens=tuple(args.cached_tokens), suffix_tokens=args.suffix_tokens,
                          warmup=args.warmup, iterations=args.iterations,
                          throughput_requests=args.throughput_requests,
                          throughput_prompt_tokens=args.throughput_prompt_tokens,
                          throughput_output_tokens=args.throughput_output_tokens,
                          throughput_rounds=args.throughput_rounds, seed=args.bench_seed)
    _set_threads(args)
    result = run_ttft_bench(engine_config_from_args(args), cfg)
    code = _finish(args, result, format_ttft_report(result))
    if args.plot:
        try:
            plot_ttft(result, args.plot)
            print(f"[bench] plot written to {args.plot}", file=sys.stderr)
        except ImportError:
            print("[bench] --plot needs matplotlib (pip install 'hybridserve[bench]')", file=sys.stderr)
    return code


def run_chat(args: argparse.Namespace) -> int:
    """Handler of `bench chat`."""
    from hybridserve.bench.chat_bench import (
        ChatBenchConfig,
        format_chat_report,
        run_chat_bench,
    )

    _set_threads(args)
    cfg = ChatBenchConfig(conversations=args.conversations, turns=args.turns, system_tokens=args.system_tokens,
                          message_tokens=args.message_tokens, reply_tokens=args.reply_tokens, seed=args.bench_seed)
    result = run_chat_bench(engine_config_from_args(args), cfg)
    return _finish(args, result, format_chat_report(result))


def run_trace(args: argparse.Namespace) -> int:
    """Handler of `bench trace`."""
    from hybridserve.bench.trace_bench import (
        TraceBenchConfig,
        format_trace_report,
        run_trace_bench,
    )

    cfg = TraceBenchConfig(trace_path=args.trace, num_requests=args.num_requests, block_tokens=args.block_tokens,
                           max_output_tokens=args.max_output_tokens, max_concurrency=args.max_concurrency,
                           progress=not args.no_progress)
    _set_threads(args)
    result = run_trace_bench(engine_config_from_args(args), cfg)
    return _finish(args, result, format_trace_report(result))


def run_structured(args: argparse.Namespace) -> int:
    """Handler of `bench structured`."""
    from hybridserve.bench.structured_bench import (
        StructuredBenchConfig,
        format_structured_report,
        run_structured_bench,
    )

    cfg = StructuredBenchConfig(batch_sizes=tuple(args.batch_sizes), prompt_tokens=args.prompt_tokens,
                                decode_tokens=args.decode_tokens, warmup=args.warmup, iterations=args.iterations,
                                seed=args.bench_seed)
    _set_threads(args)
    result = run_structured_bench(engine_config_from_args(args), cfg)
    return _finish(args, result, format_structured_report(result))


def run_all(args: argparse.Namespace) -> int:
    """Handler of `bench all`: the other benchmarks in turn, default sizes, one combined JSON."""
    from hybridserve.bench.engine_bench import (
        EngineBenchConfig,
        format_engine_report,
        run_engine_bench,
    )
    from hybridserve.bench.trace_bench import (
        TraceBenchConfig,
        format_trace_report,
        run_trace_bench,
    )
    from hybridserve.bench.ttft_bench import (
        TTFTBenchConfig,
        format_ttft_report,
        plot_ttft,
        run_ttft_bench,
    )

    _set_threads(args)
    config = engine_config_from_args(args)
    results: dict[str, Any] = {}
    results["engine"] = run_engine_bench(config, EngineBenchConfig())
    print("== bench engine ==\n" + format_engine_report(results["engine"]), flush=True)
    results["ttft"] = run_ttft_bench(config, TTFTBenchConfig())
    print("\n== bench ttft ==\n" + format_ttft_report(results["ttft"]), flush=True)
    if args.plot:
        plot_ttft(results["ttft"], args.plot)
    if args.with_trace:
        results["trace"] = run_trace_bench(config, TraceBenchConfig(progress=False))
        print("\n== bench trace ==\n" + format_trace_report(results["trace"]), flush=True)
    return _finish(args, results, "")

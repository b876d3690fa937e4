"""`hybridserve` command line: generate, serve, bench, sim.

Building the parser imports no torch (every heavy import is inside the command that needs it), so
`--help` answers at once. `main` gives this process the OpenMP and oneDNN environment an engine
wants before any command loads torch (`engine.threads.prepare_command_process`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from hybridserve.engine.threads import prepare_command_process
from hybridserve.engine_args import add_engine_arguments


def _subcommand(subparsers: argparse._SubParsersAction[argparse.ArgumentParser], name: str,
                help_text: str) -> argparse.ArgumentParser:
    return subparsers.add_parser(name, help=help_text, formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def run_generate(args: argparse.Namespace) -> int:
    """Load the engine, complete `--prompt`, print the text and timings."""
    from hybridserve.engine.engine import LLMEngine
    from hybridserve.engine_args import engine_config_from_args
    from hybridserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sample_seed, ignore_eos=args.ignore_eos)
    engine = LLMEngine(engine_config_from_args(args))
    print(f"[hybridserve] {engine.describe()}", file=sys.stderr)
    start = time.perf_counter()
    engine.add_request("cli-0", args.prompt, params)
    first_token = None
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if first_token is None and output.outputs[0].token_ids:
                first_token = time.perf_counter()
            final = output if output.finished else final
    total = time.perf_counter() - start
    assert final is not None and first_token is not None
    completion = final.outputs[0]
    decode_tokens = max(len(completion.token_ids) - 1, 1)
    print(args.prompt + completion.text)
    print(f"[hybridserve] prompt_tokens={len(final.prompt_token_ids)} completion_tokens={len(completion.token_ids)} "
          f"finish_reason={completion.finish_reason} ttft={1000 * (first_token - start):.1f} ms "
          f"decode={1000 * (total - (first_token - start)) / decode_tokens:.1f} ms/token total={total:.2f} s",
          file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `hybridserve` parser and its subcommands' flags."""
    from hybridserve.server.cli import add_serve_arguments, run_server
    from hybridserve.sim.cli import add_sim_arguments

    parser = argparse.ArgumentParser(prog="hybridserve", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    generate = _subcommand(subparsers, "generate", "complete one prompt and print it with its timing")
    add_engine_arguments(generate)
    generate.add_argument("--prompt", default="The joint prefix cache of a hybrid model", help="prompt text")
    generate.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    generate.add_argument("--top-k", type=int, default=-1, help="-1 = disabled")
    generate.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    generate.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    generate.set_defaults(handler=run_generate)
    serve = _subcommand(subparsers, "serve", "OpenAI-compatible HTTP server")
    add_serve_arguments(serve)
    serve.set_defaults(handler=run_server)
    add_sim_arguments(_subcommand(subparsers, "sim", "replay a request trace through the cache policies (no model)"))
    try:
        from hybridserve.bench.cli import add_bench_arguments

        add_bench_arguments(_subcommand(subparsers, "bench", "benchmarks (figures in docs/benchmarks.md)"))
    except ImportError:  # benchmarks need their optional dependencies
        pass
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `hybridserve` script."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    prepare_command_process()  # before any command imports torch (and with it OpenMP)
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except ValueError as error:
        print(f"hybridserve: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""`python -m benchmarks.peer [flags]`: hybridserve against native llama.cpp (see `peer_bench`).

Build llama.cpp first: `benchmarks/peer/build_llama_cpp.sh` (or `make bench-peer`, which does both).
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.peer.peer_bench import PeerBenchConfig, format_peer_report, run_peer_bench
from hybridserve.bench.configs import add_config_arguments, config_from_args


def main(argv: list[str] | None = None) -> int:
    """Run the comparison, print the tables, optionally write JSON; exit status 2 when llama.cpp is missing."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peer", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_arguments(parser, PeerBenchConfig)
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    try:
        result = run_peer_bench(config_from_args(PeerBenchConfig, args),
                                log=lambda line: print(line, file=sys.stderr, flush=True))
    except RuntimeError as exc:
        if "needs" not in str(exc):
            raise
        print(f"[peer] {exc}", file=sys.stderr)
        return 2
    print(format_peer_report(result))
    if args.json:
        from hybridserve.bench.common import write_json

        write_json(args.json, result)
        print(f"[peer] figures written to {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m benchmarks.replay_floor`: the fastest any prefix cache could make `bench trace`'s replay.

`hybridserve bench trace` replays the scaled conversation trace one request at a time with the cache
on and off and reports time on/off. Part of every request's time no hit can save: the decode steps,
and each prefill forward's fixed cost (on the CPU, streaming the weights once per forward, whatever
the number of tokens). This measures that floor for the hits the cache actually got:

1. the `bench trace` replay (cache on and off, stepped alternately) gives each request's live hit;
2. two cache-off engines then replay the same requests alternately: each prompt whole ("full"), and
   each prompt without the tokens its hit restored ("suffix"), with the same output lengths.

suffix/full is below any cache's time on/off with those hits: it computes exactly the tokens the
cache left, and nothing else, not even attention over the restored prefix or a restore. A goal
below it is out of reach for this replay on this machine, whatever the cache does.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, cast

import torch

from hybridserve.bench.common import cache_on_off, finish
from hybridserve.bench.trace_bench import _Replay, _replay_alternating
from hybridserve.engine.engine import LLMEngine
from hybridserve.engine_args import engine_config_from_args
from hybridserve.server.cli import build_parser
from hybridserve.sim.trace import TraceTokens, default_trace_path, read_trace

BLOCK_TOKENS = 16  # as `bench trace`: tokens per 512-token trace block
MAX_OUTPUT_TOKENS = 8


class _Suffixes:
    """`TraceTokens` as a replay reads it, each prompt without its first `hits[i]` tokens."""

    def __init__(self, tokens: TraceTokens, hits: list[int]) -> None:
        self.records = tokens.records
        self._tokens = tokens
        self._hits = hits

    def prompt(self, index: int) -> list[int]:
        """The prompt's tokens after the hit."""
        return self._tokens.prompt(index)[self._hits[index]:]

    @staticmethod
    def has_output(index: int) -> bool:
        """Outputs are already known (from the first replay); the suffix replay keeps them."""
        return True


def _replay(engines: dict[str, LLMEngine], tokens: dict[str, Any]) -> dict[str, _Replay]:
    """Step the engines alternately through their replays (each one's `seconds` and `outputs`)."""
    replays = {label: _Replay(engine, label, cast(TraceTokens, tokens[label]), 1) for label, engine in engines.items()}
    with torch.inference_mode():
        _replay_alternating(list(replays.values()), progress=False)
    return replays


def run(num_requests: int, engine_flags: list[str], log: Any = print) -> dict[str, Any]:
    """Both phases; the figures as a dict."""
    config = engine_config_from_args(build_parser().parse_args(engine_flags))
    on_config, off_config = cache_on_off(config)
    records = read_trace(str(default_trace_path()), num_requests, BLOCK_TOKENS, MAX_OUTPUT_TOKENS)
    on, off = LLMEngine(on_config), LLMEngine(off_config)
    tokens = TraceTokens(records, BLOCK_TOKENS, on.model_config.vocab_size)
    replays = _replay({"on": on, "off": off}, {"on": tokens, "off": tokens})
    hits = [o.num_cached_tokens if o is not None else 0 for o in replays["on"].outputs]
    measured = {label: replay.seconds for label, replay in replays.items()}
    finish(off, on)
    log(f"phase 1 (bench trace): on {measured['on']:.1f} s, off {measured['off']:.1f} s, "
        f"time on/off {measured['on'] / measured['off']:.3f}")
    full, suffix = LLMEngine(off_config), LLMEngine(off_config)
    floor = {label: replay.seconds for label, replay in
             _replay({"full": full, "suffix": suffix}, {"full": tokens, "suffix": _Suffixes(tokens, hits)}).items()}
    finish(full, suffix)
    prompt_tokens = sum(len(tokens.prompt(i)) for i in range(len(records)))
    result = {"num_requests": len(records), "prompt_tokens": prompt_tokens, "hit_tokens": sum(hits),
              "on_s": measured["on"], "off_s": measured["off"], "full_s": floor["full"], "suffix_s": floor["suffix"],
              "time_on_off": measured["on"] / measured["off"], "floor": floor["suffix"] / floor["full"],
              "engine_flags": engine_flags}
    log(f"phase 2 (cache off): full prompts {floor['full']:.1f} s, prompts after their hits "
        f"{floor['suffix']:.1f} s\n"
        f"prefill tokens on/off {1 - sum(hits) / prompt_tokens:.3f}; time on/off {result['time_on_off']:.3f}; "
        f"floor (suffix/full) {result['floor']:.3f}")
    return result


def main(argv: list[str] | None = None) -> int:
    """Run both phases and print the figures (optionally as JSON)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replay_floor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=800, help="replay the first N requests (as bench trace)")
    parser.add_argument("--json", metavar="PATH", default=None)
    parser.add_argument("engine_flags", nargs="*", default=["--prefix-cache-mib", "4", "--host-cache-memory", "4GiB"],
                        help="`hybridserve serve` flags for the cache-on engine, after `--` "
                             "(default: --prefix-cache-mib 4 --host-cache-memory 4GiB)")
    args = parser.parse_args(argv)
    result = run(args.num_requests, args.engine_flags)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The settings of every `hybridserve bench` command, and the flags generated from them.

A field declared with `option(default, help)` is also a flag `--field-name` (or the `flag` given):
a tuple takes several values, a bool is a switch (`--no-name` when it defaults to True). Imports no
torch, so `hybridserve bench --help` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

ConfigT = TypeVar("ConfigT")
WEIGHT_VARIANTS = ("float32", "bfloat16", "int8")
SERVE_WORKLOADS = ("shared-prefix", "no-reuse")
HTTP_CLIENTS = ("aiohttp", "httpx", "aiohttp-whole")  # aiohttp-whole: not streamed (what streaming costs)
SEED_FLAG = "--bench-seed"  # `--seed` is the engine's


def option(default: Any, help: str, *, flag: str | None = None, choices: Sequence[Any] | None = None) -> Any:
    """A dataclass field that is also a command-line flag."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag, "choices": choices})


def seed_option(what: str = "the random prompts") -> Any:
    """The `--bench-seed` field every benchmark has."""
    return option(0, f"seed of {what}", flag=SEED_FLAG)


def _flag_fields(config_cls: type) -> list[tuple[dataclasses.Field[Any], Any, str]]:
    """(field, resolved type, destination) of every field declared with `option`."""
    hints = typing.get_type_hints(config_cls)
    rows = []
    for field in dataclasses.fields(config_cls):
        if "help" in field.metadata:
            flag = field.metadata["flag"]
            dest = flag.lstrip("-").replace("-", "_") if flag and hints[field.name] is not bool else field.name
            rows.append((field, hints[field.name], dest))
    return rows


def add_config_arguments(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """Add a flag for every `option` field of the dataclass `config_cls`."""
    for field, kind, dest in _flag_fields(config_cls):
        meta = field.metadata
        if kind is bool:
            name = field.name.replace("_", "-")
            flag = meta["flag"] or (f"--no-{name}" if field.default else f"--{name}")
            # "%(default).0s" prints nothing: the dest's default would read backwards next to a --no- flag
            parser.add_argument(flag, dest=dest, action="store_false" if field.default else "store_true",
                                help=meta["help"] + "%(default).0s")
            continue
        nargs = None
        if typing.get_origin(kind) is tuple:
            kind, nargs = typing.get_args(kind)[0], "+"
        elif typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
        default: Any = field.default
        if nargs:
            default = list(default)
        parser.add_argument(meta["flag"] or "--" + field.name.replace("_", "-"), dest=dest, type=kind, nargs=nargs,
                            default=default, choices=meta["choices"], help=meta["help"])


def config_from_args(config_cls: type[ConfigT], args: argparse.Namespace, **overrides: Any) -> ConfigT:
    """The `config_cls` the flags describe (`overrides` win)."""
    values = {}
    for field, kind, dest in _flag_fields(config_cls):
        value = getattr(args, dest)
        values[field.name] = tuple(value) if typing.get_origin(kind) is tuple else value
    return config_cls(**(values | overrides))


@dataclass(frozen=True)
class EngineBenchConfig:
    """hybridserve vs transformers (same weights): prefill, decode, batching, FLOP rate"""

    prompt_tokens: int = option(4160, "cold prefill prompt length")
    decode_prompt_tokens: int = option(32, "prompt length before decoding")
    decode_tokens: int = option(64, "tokens generated per decode run")
    batch_size: int = option(16, "batch of the aggregate decode measure")
    warmup: int = option(1, "discarded iterations")
    iterations: int = option(5, "measured iterations")
    matmul_size: int = option(2048, "side of the matmul that sets the peak")
    matmul_repeats: int = 3
    seed: int = seed_option()


@dataclass(frozen=True)
class DecodeBenchConfig:
    """batch-1 decode vs the time to read the weights once, for float32, bfloat16 and int8 weights side by side,
    and their quality against float32"""

    variants: tuple[str, ...] = option(WEIGHT_VARIANTS, "weight formats to compare", choices=WEIGHT_VARIANTS)
    prompt_tokens: int = option(64, "prompt length before decoding")
    decode_tokens: int = option(64, "tokens decoded per measured request")
    quality_prompts: int = option(4, "prompts of the quality comparison")
    quality_prompt_tokens: int = 256
    greedy_tokens: int = option(64, "greedy tokens compared per prompt")
    warmup: int = option(1, "discarded rounds")
    iterations: int = option(5, "measured rounds")
    seed: int = seed_option()


@dataclass(frozen=True)
class TTFTBenchConfig:
    """TTFT with the joint prefix cache off vs on, floor, no-reuse throughput"""

    cached_tokens: tuple[int, ...] = option((256, 512, 1024, 2048, 4096), "cached prefix lengths (one row each)")
    suffix_tokens: int = option(64, "fresh tokens after the cached prefix")
    warmup: int = option(1, "extra warm-hit runs per row, discarded")
    iterations: int = option(9, "measured iterations per row")
    throughput_requests: int = option(16, "requests of the no-reuse workload")
    throughput_prompt_tokens: int = option(512, "prompt length there")
    throughput_output_tokens: int = option(32, "output tokens there")
    throughput_rounds: int = option(1, "ABBA rounds (4 runs each)")
    seed: int = seed_option()


@dataclass(frozen=True)
class TraceBenchConfig:
    """scaled replay of the Mooncake conversation trace, cache on vs off"""

    trace_path: str = option("", "trace JSONL (default: ../shared/traces/mooncake_conversation.jsonl next to the "
                             "repository)", flag="--trace")
    num_requests: int = option(800, "replay the first N requests")
    block_tokens: int = option(16, "tokens per 512-token trace block")
    max_output_tokens: int = option(8, "cap on output tokens")
    max_concurrency: int = option(1, "requests in the engine at once")
    progress: bool = option(True, "no progress bar")


@dataclass(frozen=True)
class ChatBenchConfig:
    """interleaved multi-turn conversations, TTFT per turn with the cache on vs off"""

    conversations: int = option(4, "conversations played round-robin")
    turns: int = option(8, "turns per conversation")
    system_tokens: int = option(1024, "system prompt length")
    message_tokens: int = option(160, "new user tokens per turn")
    reply_tokens: int = option(48, "generated tokens per turn")
    long_after_tokens: int = 2048  # turns whose history exceeds this form the headline figure
    seed: int = seed_option("the random messages")


@dataclass(frozen=True)
class StructuredBenchConfig:
    """decode step time with a JSON schema active vs unconstrained, batch 1 and 16"""

    batch_sizes: tuple[int, ...] = option((1, 16), "one row each")
    prompt_tokens: int = option(32, "prompt length before decoding")
    decode_tokens: int = option(48, "tokens generated per run")
    warmup: int = option(1, "discarded iterations")
    iterations: int = option(4, "measured iterations (alternating order)")
    seed: int = seed_option("prompts and sampling")


@dataclass(frozen=True)
class TPBenchConfig:
    """prefill and decode at TP=1 (1 and 2 threads) vs TP=2 (1 thread per rank), with the all-reduce and
    transport shares of a step"""

    prompt_tokens: int = option(1024, "cold prefill prompt length")
    decode_tokens: int = option(32, "tokens decoded per run")
    iterations: int = option(3, "measured iterations (alternating order)")
    seed: int = seed_option()


@dataclass(frozen=True)
class ServeBenchConfig:
    """Sizes of `bench serve` (token counts are prompt token ids sent as-is)."""

    concurrency: tuple[int, ...] = option((1, 4, 8, 16), "client counts")
    num_requests: int = option(32, "requests per (workload, concurrency)")
    prefix_tokens: int = option(1024, "shared prefix length")
    suffix_tokens: int = option(64, "unique suffix length")
    max_tokens: int = option(32, "output tokens per request (EOS ignored)")
    workloads: tuple[str, ...] = option(SERVE_WORKLOADS, "workloads", choices=SERVE_WORKLOADS)
    mixed: bool = option(True, "skip the mixed-load case")
    mixed_background: int = option(4, "background decoders")
    mixed_background_prompt_tokens: int = option(64, "their prompt length")
    mixed_background_max_tokens: int = option(1024, "their output cap (they are cancelled after the injection)")
    mixed_baseline_chunks: int = option(16, "chunks each background stream receives before the injection")
    mixed_prefix_tokens: int = option(2048, "warm prefix of the injected request")
    mixed_suffix_tokens: int = option(128, "its fresh suffix")
    mixed_max_tokens: int = option(8, "its output tokens")
    token_logprobs: bool = option(True, "do not request logprobs=0 (then tokens whose text is still empty send no "
                                  "chunk)", flag="--no-logprobs")
    request_timeout_s: float = option(300.0, "seconds per request", flag="--request-timeout")
    level_timeout_s: float = option(900.0, "seconds after which a level stops issuing requests",
                                    flag="--level-timeout")
    seed: int = seed_option()


@dataclass(frozen=True)
class CompareConfig:
    """Sizes of `bench serve --compare-offline` (its seed is `--bench-seed`)."""

    decode_prompt_tokens: int = 64
    decode_tokens: int = option(128, "tokens of the decode measure", flag="--compare-decode-tokens")
    ttft_prefix_tokens: int = option(4096, "warm prefix of the TTFT measure", flag="--compare-ttft-prefix")
    ttft_suffix_tokens: int = 64
    clients: int = option(16, "concurrent streams", flag="--compare-clients")
    client_prompt_tokens: int = 64
    client_max_tokens: int = 64
    warmup: int = 1
    repeats: int = option(5, "measured runs per figure", flag="--compare-repeats")
    modes: tuple[str, ...] = option(("off", "on"), "--engine-process modes of the servers compared",
                                    flag="--compare-modes", choices=("off", "on"))
    http_clients: tuple[str, ...] = option(("aiohttp", "httpx"), "HTTP client libraries the servers are measured "
                                           "with (each its own row, in turns); aiohttp-whole sends the same "
                                           "requests not streamed", flag="--compare-http-clients",
                                           choices=HTTP_CLIENTS)
    seed: int = 0

"""Command-line flags shared by every command that builds an engine (generate, serve, bench)."""

from __future__ import annotations

import argparse

from hybridserve.config import CacheConfig, EngineConfig, SchedulerConfig


def add_engine_arguments(parser: argparse.ArgumentParser, *, model_positional: bool = False) -> None:
    """Add model, device and pool-size flags (defaults shown with ArgumentDefaultsHelpFormatter)."""
    if model_positional:
        parser.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                            help="model directory (Hugging Face layout); same as --model")
    parser.add_argument("--model", default=None,
                        help="model directory (Hugging Face layout); the built-in model when omitted")
    parser.add_argument("--prefix-cache-mib", type=float, default=1024.0,
                        help="memory for GDN state snapshots of the joint prefix cache (0 disables it)")
    parser.add_argument("--snapshot-interval", type=int, default=256,
                        help="tokens between GDN state snapshots (a multiple of the block size)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    parser.add_argument("--kv-cache-mib", type=float, default=256.0, help="memory for the paged KV cache")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="most requests running at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="most tokens in one step (while requests decode, prefill is further capped)")
    parser.add_argument("--max-prefill-tokens-during-decode", type=int, default=32,
                        help="while requests decode, prefill at most this many tokens per step (bounds "
                             "inter-token latency; 0 = no cap)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length limit; when unset, the model's max_position_embeddings")
    parser.add_argument("--max-waiting-requests", type=int, default=256,
                        help="queued requests beyond which new ones are refused")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="weight and activation dtype (auto: float32 on CPU, bfloat16 on GPU)")
    parser.add_argument("--device", default="auto", help="torch device (auto, cpu, cuda, cuda:1, ...)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the engine's random state")


def model_from_args(args: argparse.Namespace) -> str | None:
    """The model directory: the positional MODEL or `--model` (ValueError if they disagree)."""
    positional = getattr(args, "model_positional", None)
    if positional is not None and args.model is not None and positional != args.model:
        raise ValueError(f"two different models given: {positional!r} and --model {args.model!r}")
    return positional if positional is not None else args.model


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` the flags describe (raises `ValueError` on invalid values)."""
    cache = CacheConfig(block_size=args.block_size, kv_cache_mib=args.kv_cache_mib,
                        prefix_cache_mib=args.prefix_cache_mib, snapshot_interval=args.snapshot_interval)
    scheduler = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                max_model_len=args.max_model_len, max_waiting_requests=args.max_waiting_requests,
                                max_prefill_tokens_during_decode=args.max_prefill_tokens_during_decode)
    return EngineConfig(model=model_from_args(args), device=args.device, dtype=args.dtype, seed=args.seed,
                        cache=cache, scheduler=scheduler)

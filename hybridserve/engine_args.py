"""Command-line flags shared by every command that builds an engine (generate, serve, bench)."""

from __future__ import annotations

import argparse

from hybridserve.cache.block_pool import parse_seed
from hybridserve.config import (
    BLOCK_HASHES,
    DEFAULT_CPU_KV_CACHE_MIB,
    DEFAULT_CPU_PREFIX_CACHE_MIB,
    POLICY_NAMES,
    TIER_WRITE_POLICIES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    parse_size,
)


def _seed_flag(text: str) -> int:
    """`--block-hash-seed`'s value, with the reason in argparse's error when it is not a seed."""
    try:
        return parse_seed(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_engine_arguments(parser: argparse.ArgumentParser, *, model_positional: bool = False) -> None:
    """Add model, device and pool-size flags (defaults shown with ArgumentDefaultsHelpFormatter)."""
    if model_positional:
        parser.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                            help="model directory (Hugging Face layout); same as --model")
    parser.add_argument("--model", default=None,
                        help="model directory (Hugging Face layout) or Hub id (org/name, fetched through "
                             "huggingface_hub; HF_HUB_OFFLINE=1: its cache only); the built-in model when omitted")
    parser.add_argument("--prefix-cache-mib", type=float, default=None,
                        help="memory for GDN state snapshots of the joint prefix cache (0 disables it); when "
                             "unset, planned (see --memory-fraction), or on CPU sized to the model and the RAM "
                             f"available (at most {DEFAULT_CPU_PREFIX_CACHE_MIB:g}; see docs/serving.md, Sizing)")
    parser.add_argument("--snapshot-interval", type=int, default=256,
                        help="tokens between GDN state snapshots (a multiple of the block size)")
    parser.add_argument("--cache-policy", default="hybridserve", metavar="{" + ",".join(POLICY_NAMES) + "}",
                        help="which GDN states the prefix cache keeps and evicts (see docs/prefix-cache.md)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    parser.add_argument("--kv-cache-mib", type=float, default=None,
                        help="memory for the paged KV cache; when unset, planned (see --memory-fraction), or "
                             "on CPU sized to the model and the RAM available (at most "
                             f"{DEFAULT_CPU_KV_CACHE_MIB:g}, at least one max-model-len request)")
    parser.add_argument("--memory-fraction", type=float, default=None,
                        help="fraction of device memory this engine may use (CUDA: of total memory, default "
                             "0.9; CPU: of the RAM available at start); the caches get what the weights and a "
                             "profiled max-size forward leave")
    parser.add_argument("--kv-cache-memory", type=parse_size, default=None,
                        help="memory for the KV pool and the snapshot pool together (e.g. 2GiB); skips profiling")
    parser.add_argument("--snapshot-memory-share", type=float, default=0.5,
                        help="share of planned cache memory given to GDN snapshots (the rest is KV)")
    parser.add_argument("--block-hash", default="xxh3_128", choices=BLOCK_HASHES,
                        help="KV block hash: xxh3_128 (fast, keyed by a secret seed) or sha256 (collision-resistant)")
    parser.add_argument("--block-hash-seed", type=_seed_flag, default=None, metavar="SEED",
                        help="64-bit seed keying the xxh3_128 block hash (decimal or 0x-hex), for hashes stable "
                             "across processes; default: $HYBRIDSERVE_BLOCK_HASH_SEED, else a seed file kept in "
                             "--disk-cache-dir, else random per engine start")
    parser.add_argument("--host-cache-memory", default=None, metavar="SIZE",
                        help="host memory for a joint-cache tier below the device pools (e.g. 64GiB; pageable, "
                             "also on CUDA); off when unset")
    parser.add_argument("--disk-cache-dir", default=None, metavar="DIR",
                        help="directory of a persistent joint-cache tier on disk (needs --disk-cache-size; kept "
                             "across restarts, one subdirectory per model fingerprint, mode 0700); off when unset")
    parser.add_argument("--disk-cache-size", default=None, metavar="SIZE",
                        help="most bytes the disk tier may hold (e.g. 512GiB); least recently used objects go first")
    parser.add_argument("--tier-write-policy", default="write-through", choices=TIER_WRITE_POLICIES,
                        help="write-through: copy an entry one tier down when it is cached (an eviction then "
                             "costs nothing; with a disk tier alone, what is cached survives a restart or a "
                             "crash); write-back: "
                             "copy it only when it is evicted from the tier above (less copying, but the "
                             "copy lands in the admission that evicts it, and what the device holds at "
                             "shutdown is not written)")
    parser.add_argument("--remote-cache-url", default=None, metavar="URL",
                        help="redis://HOST:PORT/DB of a Redis server shared by replicas as the last joint-cache "
                             "tier (each published entry is written through; other replicas' entries are found "
                             "at admission); needs --block-hash-seed, the same on every replica; off when unset")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for the forward (when unset: every available core, idle OpenMP "
                             "workers sleeping; all cores but one if torch was imported before hybridserve)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="split the model over N ranks (worker processes; gloo on CPU with the threads "
                             "divided among them, NCCL on GPUs; multi-node under torchrun, see README)")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="most requests running at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="most tokens in one step (while requests decode, prefill is further capped)")
    parser.add_argument("--max-prefill-tokens-during-decode", type=int, default=12,
                        help="while requests decode, prefill at most this many tokens per step for each "
                             "request owed prompt tokens (bounds inter-token latency; 0 = no cap)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length limit; when unset, the model's max_position_embeddings")
    parser.add_argument("--max-waiting-requests", type=int, default=256,
                        help="queued requests beyond which new ones are refused")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="weight and activation dtype (auto: float32 on CPU, bfloat16 on GPU)")
    parser.add_argument("--quantization", default=None, choices=("int8",),
                        help="weight-only int8 linears (per-channel scales, quantized at load; on CPU the "
                             "GEMM input is rounded to bfloat16, see docs/benchmarks.md for the quality cost)")
    parser.add_argument("--device", default="auto", help="torch device (auto, cpu, cuda, cuda:1, ...)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the engine's random state")


def model_from_args(args: argparse.Namespace) -> str | None:
    """The model directory: the positional MODEL or `--model` (ValueError if they disagree)."""
    positional = getattr(args, "model_positional", None)
    if positional is not None and args.model is not None and positional != args.model:
        raise ValueError(f"two different models given: {positional!r} and --model {args.model!r}")
    model: str | None = positional if positional is not None else args.model
    return model


def _size_flag(args: argparse.Namespace, name: str) -> int | None:
    """Bytes of the size flag `--name` (None when unset); `ValueError` naming the flag."""
    text = getattr(args, name.replace("-", "_"), None)
    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as error:
        raise ValueError(f"--{name}: {error}") from None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` the flags describe (raises `ValueError` on invalid values)."""
    cache = CacheConfig(block_size=args.block_size, kv_cache_mib=args.kv_cache_mib,
                        prefix_cache_mib=args.prefix_cache_mib, snapshot_interval=args.snapshot_interval,
                        cache_policy=args.cache_policy,
                        kv_cache_memory_bytes=args.kv_cache_memory, memory_fraction=args.memory_fraction,
                        snapshot_memory_share=args.snapshot_memory_share, block_hash=args.block_hash,
                        block_hash_seed=args.block_hash_seed,
                        host_cache_memory_bytes=_size_flag(args, "host-cache-memory") or 0,
                        disk_cache_dir=args.disk_cache_dir, disk_cache_size_bytes=_size_flag(args, "disk-cache-size"),
                        tier_write_policy=args.tier_write_policy, remote_cache_url=args.remote_cache_url)
    scheduler = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                max_model_len=args.max_model_len, max_waiting_requests=args.max_waiting_requests,
                                max_prefill_tokens_during_decode=args.max_prefill_tokens_during_decode)
    return EngineConfig(model=model_from_args(args), device=args.device, dtype=args.dtype, seed=args.seed,
                        num_threads=args.threads, quantization=args.quantization,
                        tensor_parallel_size=args.tensor_parallel_size, cache=cache, scheduler=scheduler)

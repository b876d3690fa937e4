"""hybridserve against native llama.cpp on the same weights, side by side.

llama.cpp runs as its users run it: `llama-server`, `llama-bench` and `llama-batched-bench`
built from the llama.cpp source vendored in the llama-cpp-python sdist (`build_llama_cpp.sh`).
The model (a Hugging Face dir, or the built-in model saved as one) is written as a `qwen35` GGUF
file (`gguf_export`: f32, bf16 or q8_0 for `--dtype float32|bfloat16|int8`). Every comparison
alternates between the engines (the order flips each round, only one computes at any moment),
discards warm-up rounds and reports medians:

  * engines: hybridserve's `LLMEngine` in this process against `llama-bench` (a fresh process
    per round): cold prefill of `prompt_tokens` (hybridserve: TTFT of a fresh prompt; llama.cpp:
    its prompt-processing run) and batch-1 decode ms/token (hybridserve: the median step after a
    `decode_prompt_tokens` prompt; llama.cpp: its generation run of `decode_tokens`);
  * batch scaling: the decode step of `batch_size` sequences against one sequence
    (hybridserve: `LLMEngine` steps with every request decoding; llama.cpp: `llama-batched-bench`);
  * servers: `hybridserve serve` against `llama-server`, with the same thread count and the same
    token-id prompts over `/v1/completions` (greedy, EOS ignored): cold TTFT of a fresh prompt,
    warm TTFT of a prompt sharing its first `shared_tokens` (each server reuses what its defaults
    keep), TTFT of the previous prompt extended by `extend_tokens`, and decode ms/token as
    (wall of a 1 + D token request - wall of a 1-token request) / D.

Before timing, greedy agreement: the token ids both engines generate for one prompt and the
largest log-probability difference over the agreed tokens.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from hybridserve.bench.common import common_prefix_length, format_table, median
from hybridserve.bench.configs import option, seed_option
from hybridserve.bench.serve_client import PromptSource, ServerBackend, ServerProcess

DTYPES = {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0"}  # hybridserve mode -> GGUF type
ENGINES = ("hybridserve", "llama.cpp")
PARTS = ("engines", "batch", "servers")
ENGINE_METRICS = ("prefill_ms", "decode_ms_per_token")
SERVER_METRICS = ("cold_ttft_ms", "warm_ttft_ms", "extend_ttft_ms", "decode_ms_per_token")
BINARIES = ("llama-server", "llama-bench", "llama-batched-bench")
Log = Callable[[str], None]
Sample = dict[str, float]


@dataclass(frozen=True)
class PeerBenchConfig:
    """Sizes and settings of the peer benchmark."""

    dtype: str = option("float32", "hybridserve --dtype float32 / bfloat16 / --quantization int8 against a GGUF of "
                        "f32 / bf16 / q8_0", choices=tuple(DTYPES))
    threads: int = option(2, "CPU threads of each engine")
    parts: tuple[str, ...] = option(PARTS, "comparisons to run", choices=PARTS)
    iterations: int = option(5, "measured rounds (alternating order)")
    warmup: int = option(1, "discarded rounds")
    prompt_tokens: int = option(4160, "cold prompt length (and the warm prompt's)")
    shared_tokens: int = option(4096, "prefix the warm prompt shares with the cold one")
    extend_tokens: int = option(64, "tokens the extension adds")
    decode_prompt_tokens: int = option(32, "prompt length before decoding")
    decode_tokens: int = option(128, "tokens per decode measure")
    agreement_tokens: int = option(32, "greedy tokens compared")
    batch_size: int = option(16, "sequences of the batch-scaling measure")
    batch_iterations: int = option(3, "batch-scaling rounds")
    n_ctx: int = option(8192, "llama-server context size")
    n_batch: int = option(2048, "llama.cpp logical batch size (llama-server's and llama-bench's default)")
    repack: bool = option(True, "keep llama.cpp's weights out of its repacked / AMX buffer types")
    llama_cpp_dir: str = option("bench-out/llama.cpp", "where build_llama_cpp.sh put bin/llama-server etc.")
    model: str | None = option(None, "Hugging Face model dir (the built-in model when omitted)")
    work_dir: str = option("", "where the model dir and GGUF files are kept (default: <tmp>/hybridserve-peer)")
    rebuild_gguf: bool = option(False, "write the GGUF file even if present")
    seed: int = seed_option()

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not 0 < self.shared_tokens < self.prompt_tokens:
            raise ValueError("shared_tokens must be in (0, prompt_tokens)")
        if self.n_ctx < self.prompt_tokens + self.extend_tokens + 8:
            raise ValueError("n_ctx must hold the extended prompt")
        if self.decode_tokens < 2 or self.iterations < 1:
            raise ValueError("decode_tokens must be >= 2 and iterations >= 1")
        if self.batch_size < 2 or self.batch_iterations < 1:
            raise ValueError("batch_size must be >= 2 and batch_iterations >= 1")
        if not set(self.parts) <= set(PARTS):
            raise ValueError(f"parts must be among {PARTS}, got {self.parts}")


# =========================================================================== files
def llama_cpp_binaries(cfg: PeerBenchConfig) -> dict[str, Path]:
    """The native llama.cpp programs (RuntimeError naming the build script when one is missing)."""
    paths = {name: Path(cfg.llama_cpp_dir) / "bin" / name for name in BINARIES}
    missing = [name for name, path in paths.items() if not os.access(path, os.X_OK)]
    if missing:
        raise RuntimeError(f"the peer benchmark needs {', '.join(missing)} in {cfg.llama_cpp_dir}/bin: run "
                           f"benchmarks/peer/build_llama_cpp.sh {cfg.llama_cpp_dir}")
    return paths


def prepare_model(cfg: PeerBenchConfig) -> tuple[Path, Path]:
    """(model dir hybridserve loads, GGUF file of the same weights for llama.cpp), written into the
    work dir when missing or older than the weights."""
    from benchmarks.peer.gguf_export import export_model_dir
    from hybridserve.models.builtin import save_builtin_checkpoint

    work = Path(cfg.work_dir or Path(tempfile.gettempdir()) / "hybridserve-peer")
    work.mkdir(parents=True, exist_ok=True)
    model_dir = Path(cfg.model).resolve() if cfg.model else work / "builtin-seed0"
    if not (model_dir / "config.json").is_file():
        save_builtin_checkpoint(model_dir)
    gguf_path = work / f"{model_dir.name}-{DTYPES[cfg.dtype]}.gguf"
    newest = max(p.stat().st_mtime for p in model_dir.glob("*.safetensors"))
    if cfg.rebuild_gguf or not gguf_path.is_file() or gguf_path.stat().st_mtime < newest:
        export_model_dir(model_dir, gguf_path, DTYPES[cfg.dtype])
    return model_dir, gguf_path


def hybridserve_dtype_args(cfg: PeerBenchConfig) -> list[str]:
    """`hybridserve serve` flags of the weight format."""
    return ["--dtype", "float32", "--quantization", "int8"] if cfg.dtype == "int8" else ["--dtype", cfg.dtype]


def llama_common_args(cfg: PeerBenchConfig, gguf_path: Path) -> list[str]:
    """Model, threads and buffer-type flags every llama.cpp program here takes."""
    return ["-m", str(gguf_path), "-t", str(cfg.threads), *([] if cfg.repack else ["--no-repack"])]


# =========================================================================== engines in-process
def build_engine(model_dir: Path, cfg: PeerBenchConfig) -> Any:
    """hybridserve's `LLMEngine` on the model, CPU, `cfg.threads` threads, no prefix cache."""
    from hybridserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from hybridserve.engine.engine import LLMEngine

    longest = max(cfg.prompt_tokens, cfg.batch_size * (cfg.decode_prompt_tokens + cfg.decode_tokens)) + 8
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32" if cfg.dtype == "int8"
                                  else cfg.dtype, quantization="int8" if cfg.dtype == "int8" else None,
                                  num_threads=cfg.threads, cache=CacheConfig(prefix_cache_mib=0),
                                  scheduler=SchedulerConfig(max_model_len=longest, max_num_seqs=cfg.batch_size)))


def hybridserve_greedy(driver: Any, prompt: list[int], num_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy token ids of `prompt` and the log-probability of each."""
    from hybridserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    out = driver.run(prompt, params).output.outputs[0]
    return list(out.token_ids), [step[token] for step, token in zip(out.logprobs or [], out.token_ids)]


def llama_server_greedy(url: str, prompt: list[int], num_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy token ids and their log-probabilities from llama-server's `/completion`."""
    import httpx

    body = {"prompt": prompt, "n_predict": num_tokens, "temperature": 0.0, "ignore_eos": True, "n_probs": 1,
            "cache_prompt": False, "return_tokens": True}
    data = httpx.post(f"{url}/completion", json=body, timeout=300.0).raise_for_status().json()
    probs = data["completion_probabilities"]
    return [int(p["id"]) for p in probs], [float(p["logprob"]) for p in probs]


def agreement(hs: tuple[list[int], list[float]], ll: tuple[list[int], list[float]]) -> dict[str, Any]:
    """How many leading greedy tokens agree, and the largest logprob difference over them."""
    (hs_ids, hs_logprobs), (ll_ids, ll_logprobs) = hs, ll
    agreed = common_prefix_length(hs_ids, ll_ids)
    diffs = [abs(hs_logprobs[i] - ll_logprobs[i]) for i in range(agreed)]
    same = sum(a == b for a, b in zip(hs_ids, ll_ids))
    return {"tokens": len(hs_ids), "leading_agreed": agreed, "same_positions": same,
            "max_logprob_diff": max(diffs) if diffs else float("nan"), "hybridserve_ids": hs_ids,
            "llama_cpp_ids": ll_ids}


def run_llama_bench(binary: Path, gguf_path: Path, cfg: PeerBenchConfig) -> Sample:
    """One `llama-bench` run (its own warm-up included): prefill ms and decode ms/token."""
    argv = [str(binary), *llama_common_args(cfg, gguf_path), "-p", str(cfg.prompt_tokens), "-n",
            str(cfg.decode_tokens), "-b", str(cfg.n_batch), "-r", "1", "-o", "json"]
    tests = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True, timeout=1800).stdout)
    return parse_llama_bench(tests)


def parse_llama_bench(tests: list[dict[str, Any]]) -> Sample:
    """`llama-bench -o json` output as prefill ms and decode ms/token (median of its samples)."""
    prefill = next(t for t in tests if t["n_prompt"] > 0 and t["n_gen"] == 0)
    decode = next(t for t in tests if t["n_gen"] > 0 and t["n_prompt"] == 0)
    return {"prefill_ms": median(prefill["samples_ns"]) / 1e6,
            "decode_ms_per_token": median(decode["samples_ns"]) / 1e6 / decode["n_gen"]}


def measure_engines(driver: Any, binaries: dict[str, Path], gguf_path: Path, source: PromptSource,
                    cfg: PeerBenchConfig, log: Log) -> dict[str, list[Sample]]:
    """Alternating rounds of hybridserve's engine and llama-bench."""
    from hybridserve.bench.common import greedy

    def hybridserve() -> Sample:
        prefill = driver.run(source.fresh(cfg.prompt_tokens), greedy(1)).ttft_s
        steps = driver.run(source.fresh(cfg.decode_prompt_tokens), greedy(cfg.decode_tokens)).decode_step_s
        return {"prefill_ms": 1000 * prefill, "decode_ms_per_token": 1000 * median(steps)}

    measures = {"hybridserve": hybridserve,
                "llama.cpp": lambda: run_llama_bench(binaries["llama-bench"], gguf_path, cfg)}
    return alternate(measures, cfg, "engines", log)


def run_batched_bench(binary: Path, gguf_path: Path, cfg: PeerBenchConfig) -> dict[int, float]:
    """One `llama-batched-bench` run: decode step ms at batch 1 and at `batch_size`."""
    ctx = cfg.batch_size * (cfg.decode_prompt_tokens + cfg.decode_tokens) + 64
    argv = [str(binary), *llama_common_args(cfg, gguf_path), "-tb", str(cfg.threads), "-c", str(ctx), "-npp",
            str(cfg.decode_prompt_tokens), "-ntg", str(cfg.decode_tokens), "-npl", f"1,{cfg.batch_size}",
            "--output-format", "jsonl"]
    done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=1800)
    return parse_batched_bench(done.stdout + "\n" + done.stderr)


def parse_batched_bench(output: str) -> dict[int, float]:
    """Decode step ms per batch size from `llama-batched-bench --output-format jsonl` output."""
    rows = [json.loads(line) for line in output.splitlines() if line.startswith("{") and '"speed_tg"' in line]
    return {row["pl"]: 1000 * row["t_tg"] / row["tg"] for row in rows}


def measure_batch(driver: Any, binaries: dict[str, Path], gguf_path: Path, source: PromptSource,
                  cfg: PeerBenchConfig, log: Log) -> dict[str, Any]:
    """Decode step at batch 1 and at `batch_size` for both engines, alternating rounds; and how
    many times batch 1's tokens/s the batch reaches."""
    prompts = [source.fresh(cfg.decode_prompt_tokens) for _ in range(cfg.batch_size)]

    def hybridserve() -> Sample:
        return {str(size): 1000 * median(driver.decode_steps(prompts[:size], cfg.decode_tokens)[0])
                for size in (cfg.batch_size, 1)}

    def llama_cpp() -> Sample:
        return {str(size): ms for size, ms in run_batched_bench(binaries["llama-batched-bench"], gguf_path,
                                                                 cfg).items()}

    rounds = alternate({"hybridserve": hybridserve, "llama.cpp": llama_cpp},
                       replace(cfg, iterations=cfg.batch_iterations), "batch", log)
    result: dict[str, Any] = {"batch_size": cfg.batch_size}
    for name, samples in rounds.items():
        one, many = (median(s[str(size)] for s in samples) for size in (1, cfg.batch_size))
        result[name] = {"batch_1_step_ms": one, "batch_step_ms": many, "speedup": cfg.batch_size * one / many}
    return result


# =========================================================================== servers
class LlamaServer(ServerProcess):
    """Native `llama-server` on the GGUF file, one slot, on a free loopback port."""

    def __init__(self, binary: Path, gguf_path: Path, cfg: PeerBenchConfig) -> None:
        """Starts nothing yet (a context manager, as `ServerProcess`)."""
        self.binary = binary
        super().__init__([*llama_common_args(cfg, gguf_path), "-tb", str(cfg.threads), "-c", str(cfg.n_ctx),
                          "-b", str(cfg.n_batch), "-np", "1", "--no-webui"])

    def command(self, serve_args: list[str], threads: int | None) -> list[str]:
        """`llama-server` with `serve_args`, listening on this port."""
        return [str(self.binary), *serve_args, "--host", "127.0.0.1", "--port", str(self.port)]


def measure_server_round(backend: ServerBackend, prompts: dict[str, list[int]], cfg: PeerBenchConfig) -> Sample:
    """Cold, warm and extension TTFT and decode ms/token on one server."""
    sample: Sample = {}
    for key in ("cold", "warm", "extend"):
        record = backend.request(prompts[key], 1)
        if record.prompt_tokens != len(prompts[key]):
            raise RuntimeError(f"{backend.url} counted {record.prompt_tokens} prompt tokens, sent {len(prompts[key])}")
        sample[f"{key}_ttft_ms"] = 1000 * record.ttft
        sample[f"{key}_cached_tokens"] = float(record.cached_tokens)
    _, short = backend.one(prompts["decode_short"], 1)
    _, long = backend.one(prompts["decode_long"], 1 + cfg.decode_tokens)
    sample["decode_ms_per_token"] = 1000 * (long - short) / cfg.decode_tokens
    return sample


def server_prompts(source: PromptSource, cfg: PeerBenchConfig) -> dict[str, list[int]]:
    """One round's prompts: cold; warm = its first `shared_tokens` + a new suffix; extend = warm +
    new tokens; two fresh short prompts for the decode measure."""
    cold = source.fresh(cfg.prompt_tokens)
    warm = cold[:cfg.shared_tokens] + source.fresh(cfg.prompt_tokens - cfg.shared_tokens)
    return {"cold": cold, "warm": warm, "extend": warm + source.fresh(cfg.extend_tokens),
            "decode_short": source.fresh(cfg.decode_prompt_tokens),
            "decode_long": source.fresh(cfg.decode_prompt_tokens)}


def measure_servers(model_dir: Path, gguf_path: Path, binaries: dict[str, Path], source: PromptSource,
                    cfg: PeerBenchConfig, hs_greedy: tuple[list[int], list[float]] | None,
                    agreement_prompt: list[int], log: Log) -> dict[str, Any]:
    """Both servers at once; greedy agreement, then alternating rounds (the same prompts for both)."""
    with ServerProcess([str(model_dir), *hybridserve_dtype_args(cfg)], threads=cfg.threads) as hs_server, \
            LlamaServer(binaries["llama-server"], gguf_path, cfg) as ll_server:
        result: dict[str, Any] = {"argv": {"hybridserve": hs_server.argv[2:], "llama.cpp": ll_server.argv[1:]}}
        if hs_greedy is not None:
            result["agreement"] = agreement(hs_greedy, llama_server_greedy(ll_server.url, agreement_prompt,
                                                                           cfg.agreement_tokens))
            log(f"[peer] greedy agreement: {result['agreement']['leading_agreed']}/{cfg.agreement_tokens}")
        backends = {"hybridserve": ServerBackend(hs_server.url, 1, "httpx"),
                    "llama.cpp": ServerBackend(ll_server.url, 1, "httpx")}
        try:
            prompts: dict[str, list[int]] = {}  # the round's prompts, the same for both servers
            measures = {name: (lambda backend=backend: measure_server_round(backend, prompts, cfg))
                        for name, backend in backends.items()}
            result["samples"] = alternate(measures, cfg, "servers", log,
                                          before_round=lambda: prompts.update(server_prompts(source, cfg)))
        finally:
            for backend in backends.values():
                backend.close()
    return result


# =========================================================================== driver
def alternate(measures: dict[str, Callable[[], Sample]], cfg: PeerBenchConfig, what: str, log: Log,
              before_round: Callable[[], None] | None = None) -> dict[str, list[Sample]]:
    """`warmup + iterations` rounds of every measure, the order flipping each round; warm-up rounds
    are discarded."""
    samples: dict[str, list[Sample]] = {name: [] for name in measures}
    for index in range(cfg.warmup + cfg.iterations):
        if before_round is not None:
            before_round()
        order = list(measures) if index % 2 == 0 else list(reversed(measures))
        for name in order:
            sample = measures[name]()
            tag = "warm-up" if index < cfg.warmup else f"round {index - cfg.warmup + 1}/{cfg.iterations}"
            log(f"[peer] {what} {tag} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in sample.items()))
            if index >= cfg.warmup:
                samples[name].append(sample)
    return samples


def medians(samples: dict[str, list[Sample]], metrics: tuple[str, ...]) -> dict[str, Any]:
    """Median of every measure per engine and the llama.cpp / hybridserve ratio of the medians."""
    table = {name: {key: median(s[key] for s in rows) for key in rows[0]} for name, rows in samples.items()}
    ratios = {key: table["llama.cpp"][key] / table["hybridserve"][key] for key in metrics}
    return {"median": table, "ratio_llama_cpp_over_hybridserve": ratios}


def run_peer_bench(cfg: PeerBenchConfig, log: Log = print) -> dict[str, Any]:
    """Prepare the files, then run the comparisons `cfg.parts` names."""
    from hybridserve.bench.common import EngineDriver

    binaries = llama_cpp_binaries(cfg)
    load_start = os.getloadavg()
    model_dir, gguf_path = prepare_model(cfg)
    log(f"[peer] model {model_dir}, GGUF {gguf_path} ({gguf_path.stat().st_size / 2**20:.1f} MiB)")
    source = PromptSource(cfg.seed)
    agreement_prompt = source.fresh(cfg.decode_prompt_tokens)
    result: dict[str, Any] = {"config": asdict(cfg), "model_dir": str(model_dir), "gguf": str(gguf_path),
                              "gguf_type": DTYPES[cfg.dtype]}
    engine = build_engine(model_dir, cfg)
    driver = EngineDriver(engine, "peer")
    hs_greedy = hybridserve_greedy(driver, agreement_prompt, cfg.agreement_tokens)
    if "engines" in cfg.parts:
        result["engines"] = medians(measure_engines(driver, binaries, gguf_path, source, cfg, log), ENGINE_METRICS)
    if "batch" in cfg.parts:
        result["batch_scaling"] = measure_batch(driver, binaries, gguf_path, source, cfg, log)
    engine.shutdown()
    del driver, engine
    if "servers" in cfg.parts:
        servers = measure_servers(model_dir, gguf_path, binaries, source, cfg, hs_greedy, agreement_prompt, log)
        result["servers"] = {"argv": servers["argv"], "samples": servers["samples"],
                             **medians(servers["samples"], SERVER_METRICS)}
        result["agreement"] = servers["agreement"]
    result["environment"] = environment(cfg, load_start)
    return result


def environment(cfg: PeerBenchConfig, load_start: tuple[float, float, float]) -> dict[str, Any]:
    """Date, machine, load and versions, kept with the figures."""
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    source_file = Path(cfg.llama_cpp_dir) / "SOURCE"
    return {"date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": platform.machine(), "cpu_count": os.cpu_count(), "loadavg_start": list(load_start),
            "loadavg_end": list(os.getloadavg()),
            "llama_cpp_source": source_file.read_text().strip() if source_file.is_file() else None,
            "versions": {d: version(d) for d in ("torch", "gguf")}}


# =========================================================================== report
_LABELS = {
    "prefill_ms": "cold prefill, {prompt} tokens (ms)",
    "cold_ttft_ms": "cold TTFT, {prompt} fresh tokens (ms)",
    "warm_ttft_ms": "warm TTFT, {prompt} tokens, {shared} shared, new suffix (ms)",
    "extend_ttft_ms": "warm TTFT, previous prompt + {extend} tokens (ms)",
    "decode_ms_per_token": "batch-1 decode, {decode} tokens (ms/token)",
}


def _figure_table(part: dict[str, Any], metrics: tuple[str, ...], cfg: dict[str, Any]) -> str:
    rows = [[_LABELS[key].format(prompt=cfg["prompt_tokens"], shared=cfg["shared_tokens"],
                                 extend=cfg["extend_tokens"], decode=cfg["decode_tokens"]),
             *(f"{part['median'][name][key]:.2f}" for name in ENGINES),
             f"{part['ratio_llama_cpp_over_hybridserve'][key]:.2f}"] for key in metrics]
    return format_table(["measure", *ENGINES, "llama.cpp / hybridserve"], rows)


def format_peer_report(result: dict[str, Any]) -> str:
    """The medians side by side with their ratios, per comparison, plus agreement and cache lines."""
    cfg = result["config"]
    lines = [f"peer: hybridserve vs native llama.cpp, --dtype {cfg['dtype']} (GGUF {result['gguf_type']}), "
             f"{cfg['threads']} threads each, medians of {cfg['iterations']} alternating rounds"]
    if "engines" in result:
        lines += ["in-process: hybridserve LLMEngine vs llama-bench",
                  _figure_table(result["engines"], ENGINE_METRICS, cfg)]
    scaling = result.get("batch_scaling")
    if scaling:
        size = scaling["batch_size"]
        lines.append(f"decode step at batch {size} vs batch 1 (hybridserve LLMEngine vs llama-batched-bench): " +
                     "; ".join(f"{name} {scaling[name]['batch_step_ms']:.2f} vs {scaling[name]['batch_1_step_ms']:.2f}"
                               f" ms, {size} x batch 1 / batch {size} = {scaling[name]['speedup']:.2f}x"
                               for name in ENGINES))
    if "servers" in result:
        servers = result["servers"]
        lines += ["servers: hybridserve serve vs llama-server", _figure_table(servers, SERVER_METRICS, cfg)]
        lines.append("cached prompt tokens reported (warm / extend): " + "; ".join(
            f"{name} {servers['median'][name]['warm_cached_tokens']:.0f} / "
            f"{servers['median'][name]['extend_cached_tokens']:.0f}" for name in ENGINES))
    agreed = result.get("agreement")
    if agreed:
        lines.append(f"greedy agreement ({cfg['decode_prompt_tokens']}-token prompt): {agreed['leading_agreed']}/"
                     f"{agreed['tokens']} leading tokens equal, {agreed['same_positions']}/{agreed['tokens']} "
                     f"positions equal, max |logprob diff| over the agreed tokens {agreed['max_logprob_diff']:.2g}")
    if not cfg["repack"]:
        lines.append("llama.cpp ran without weight repacking (--no-repack)")
    return "\n".join(lines)

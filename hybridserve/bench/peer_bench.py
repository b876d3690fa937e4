"""`hybridserve bench peer`: hybridserve against llama.cpp on the same weights, side by side.

The model (a Hugging Face dir, or the built-in model saved as one) is written as a `qwen35` GGUF
file (`gguf_export`; f32, bf16 or q8_0 for `--dtype float32|bfloat16|int8`). Both servers run at
once with the same thread count, and every measurement alternates between them (the order flips
each round; one request at a time, so only one server computes at any moment):

  * cold TTFT: a fresh `prompt_tokens` prompt (1 output token, send -> response);
  * warm TTFT, shared prefix: the same first `shared_tokens` as the cold prompt, then a new suffix
    (hybridserve restores the prefix from its joint cache; llama_cpp.server keeps one live
    context and cannot rewind a recurrent state, so it re-reads the prompt);
  * warm TTFT, extension: the previous prompt plus `extend_tokens` new tokens (both engines keep
    the previous end state, so this is what llama.cpp's own prefix reuse covers);
  * batch-1 decode: a fresh short prompt, `decode_tokens` streamed greedy tokens, ms/token from
    the first to the last chunk.

Before timing, a greedy agreement check runs both engines in-process on a short prompt and
compares the generated token ids (and the log-probabilities of the agreed tokens). After the
servers, each engine runs in-process (llama.cpp in a child process, one after the other) for
the batch scaling: the decode step of `batch_size` sequences (one greedy token each per step)
against one sequence, the two sizes alternated `batch_iterations` times; llama.cpp's step is
its `llama_decode` call, hybridserve's a whole `LLMEngine.step` (sampling included).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import math
import os
import platform
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hybridserve.bench.common import format_table, median
from hybridserve.models.tokenizer import Tokenizer

DTYPES = {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0"}  # hybridserve mode -> GGUF type
METRICS = ("cold_ttft_ms", "warm_ttft_ms", "extend_ttft_ms", "decode_ms_per_token")
EXTRA_BUFTS_MODES = ("auto", "on", "off")
NEEDS_QUANTIZATION = ("--dtype int8 needs --quantization support in `hybridserve serve` (the `--quantization "
                      "int8` flag and LLM(quantization=...)), which this hybridserve does not have")


@dataclass(frozen=True)
class PeerBenchConfig:
    """Sizes and settings of `bench peer`."""

    dtype: str = "float32"
    threads: int = 2
    prompt_tokens: int = 4160
    shared_tokens: int = 4096
    extend_tokens: int = 64
    decode_prompt_tokens: int = 32
    decode_tokens: int = 128
    iterations: int = 5
    warmup: int = 1
    agreement_tokens: int = 32
    n_ctx: int = 8192
    n_batch: int = 512
    model: str | None = None
    work_dir: str = ""
    rebuild_gguf: bool = False
    seed: int = 0
    llama_cpp_extra_bufts: str = "auto"  # on / off / auto: off only when llama.cpp crashes with them
    batch_size: int = 16  # sequences of the batch-scaling measurement (0: skip it)
    batch_iterations: int = 3

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not 0 < self.shared_tokens < self.prompt_tokens:
            raise ValueError("shared_tokens must be in (0, prompt_tokens)")
        if self.n_ctx < self.prompt_tokens + self.extend_tokens + 8:
            raise ValueError("n_ctx must hold the extended prompt")
        if self.decode_tokens < 2 or self.iterations < 1:
            raise ValueError("decode_tokens must be >= 2 and iterations >= 1")
        if self.batch_size == 1 or self.batch_size < 0 or self.batch_iterations < 1:
            raise ValueError("batch_size must be 0 (skip) or >= 2, and batch_iterations >= 1")
        if self.llama_cpp_extra_bufts not in EXTRA_BUFTS_MODES:
            raise ValueError(f"llama_cpp_extra_bufts must be one of {EXTRA_BUFTS_MODES}, "
                             f"got {self.llama_cpp_extra_bufts!r}")


# =========================================================================== prompts
def word_token_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids of tokens that are one whole word with a leading space (" the", " cache") and that the
    tokenizer produces for their own text. A sequence of them decodes to a text that any
    tokenizer with the same merges and split regex maps back to the same ids, chunk by chunk."""
    words = []
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if len(text) > 1 and text[0] == " " and text[1:].isascii() and text[1:].isalpha() \
                and tokenizer.encode(text) == [token_id]:
            words.append(token_id)
    if len(words) < 16:
        raise ValueError(f"the tokenizer has only {len(words)} whole-word tokens; too few for random prompts")
    return words


class WordPrompts:
    """Random whole-word token prompts, fixed by a seed, that round-trip through text."""

    def __init__(self, tokenizer: Tokenizer, seed: int) -> None:
        self.tokenizer = tokenizer
        self.words = word_token_ids(tokenizer)
        self._random = random.Random(seed)

    def fresh(self, num_tokens: int) -> list[int]:
        """`num_tokens` random word ids."""
        return [self._random.choice(self.words) for _ in range(num_tokens)]

    def text(self, ids: list[int]) -> str:
        """The text of `ids` (checked: the tokenizer maps it back to exactly `ids`)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if self.tokenizer.encode(text) != ids:
            raise RuntimeError("a word prompt does not round-trip through the tokenizer")
        return text


# =========================================================================== model files
def hybridserve_supports_quantization() -> bool:
    """Whether `hybridserve serve` has a `--quantization` flag (int8 weights)."""
    import argparse

    from hybridserve.engine_args import add_engine_arguments

    probe = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(probe)
    return any("--quantization" in action.option_strings for action in probe._actions)


def prepare_model(cfg: PeerBenchConfig) -> tuple[Path, Path]:
    """(model dir hybridserve serves, GGUF file of the same weights for llama.cpp), written
    into the work dir when missing (the built-in model is saved as a Hugging Face dir first)."""
    from hybridserve.bench.gguf_export import export_model_dir
    from hybridserve.models.builtin import save_builtin_checkpoint

    work = Path(cfg.work_dir or Path(tempfile.gettempdir()) / "hybridserve-peer")
    work.mkdir(parents=True, exist_ok=True)
    if cfg.model:
        model_dir = Path(cfg.model).resolve()
    else:
        model_dir = work / "builtin-seed0"
        if not (model_dir / "config.json").is_file():
            save_builtin_checkpoint(model_dir)
    outtype = DTYPES[cfg.dtype]
    gguf_path = work / f"{model_dir.name}-{outtype}.gguf"
    newest = max(p.stat().st_mtime for p in model_dir.glob("*.safetensors"))
    if cfg.rebuild_gguf or not gguf_path.is_file() or gguf_path.stat().st_mtime < newest:
        export_model_dir(model_dir, gguf_path, outtype)
    return model_dir, gguf_path


def serve_args(cfg: PeerBenchConfig, model_dir: Path) -> list[str]:
    """`hybridserve serve` arguments of the mode (dtype or int8 quantization)."""
    if cfg.dtype == "int8":
        return [str(model_dir), "--dtype", "float32", "--quantization", "int8"]
    return [str(model_dir), "--dtype", cfg.dtype]


# =========================================================================== agreement
def greedy_agreement(model_dir: Path, gguf_path: Path, prompt: list[int], cfg: PeerBenchConfig,
                     log: Callable[[str], None] = print) -> dict[str, Any]:
    """Greedy continuations of `prompt` by both engines in-process: the token ids, how many
    leading tokens agree, and the largest log-probability difference over the agreed tokens.
    `llama_cpp_extra_bufts` says whether llama.cpp ran with its extra buffer types: with "auto"
    they are on unless llama.cpp crashes with them, and then off (the reason is kept)."""
    hs_ids, hs_logprobs = _hybridserve_greedy(model_dir, prompt, cfg)
    extra_bufts = cfg.llama_cpp_extra_bufts != "off"
    crash = None
    try:
        ll_ids, ll_logprobs = _in_child_process(_llama_cpp_greedy, gguf_path, prompt, cfg, extra_bufts)
    except PeerCrashed as exc:
        if cfg.llama_cpp_extra_bufts != "auto":
            raise
        crash = str(exc)
        log(f"[peer] {crash}; retrying with llama.cpp's extra buffer types off")
        extra_bufts = False
        ll_ids, ll_logprobs = _in_child_process(_llama_cpp_greedy, gguf_path, prompt, cfg, extra_bufts)
    agreed = next((i for i, (a, b) in enumerate(zip(hs_ids, ll_ids)) if a != b), min(len(hs_ids), len(ll_ids)))
    diffs = [abs(hs_logprobs[i] - ll_logprobs[i]) for i in range(agreed)]
    return {"prompt_tokens": len(prompt), "tokens": cfg.agreement_tokens, "leading_agreed": agreed,
            "same_positions": sum(a == b for a, b in zip(hs_ids, ll_ids)),
            "max_logprob_diff": max(diffs) if diffs else float("nan"),
            "hybridserve_ids": hs_ids, "llama_cpp_ids": ll_ids,
            "llama_cpp_extra_bufts": extra_bufts, "llama_cpp_crash_with_extra_bufts": crash}


def _hybridserve_greedy(model_dir: Path, prompt: list[int], cfg: PeerBenchConfig) -> tuple[list[int], list[float]]:
    from hybridserve.api import LLM
    from hybridserve.sampling_params import SamplingParams

    kwargs: dict[str, Any] = {"dtype": "float32", "quantization": "int8"} if cfg.dtype == "int8" \
        else {"dtype": cfg.dtype}
    llm = LLM(str(model_dir), device="cpu", num_threads=cfg.threads, kv_cache_mib=64, prefix_cache_mib=0,
              max_model_len=1024, **kwargs)
    params = SamplingParams(max_tokens=cfg.agreement_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    logprobs = [step[token] for step, token in zip(out.logprobs or [], out.token_ids)]
    del llm
    return list(out.token_ids), logprobs


class PeerCrashed(RuntimeError):
    """llama.cpp's process died (a crash inside the library, e.g. a segfault)."""


def _in_child_process(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in a spawned child process, so that a crash inside llama.cpp's C code ends with a
    clear error instead of taking the benchmark down (seen with q8_0 on an AVX-512/AMX CPU)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(fn, *args).result()
        except BrokenProcessPool as exc:
            raise PeerCrashed(f"llama.cpp crashed evaluating {args[0]} (its process died: {exc}); "
                              "this llama-cpp-python build cannot run these weights on this CPU") from exc


def _llama_cpp_greedy(gguf_path: Path, prompt: list[int], cfg: PeerBenchConfig,
                      extra_bufts: bool) -> tuple[list[int], list[float]]:
    import numpy as np
    from llama_cpp import Llama

    from hybridserve.bench.llama_cpp_launch import disable_extra_buffer_types

    if not extra_bufts:
        disable_extra_buffer_types()

    llm = Llama(model_path=str(gguf_path), n_ctx=len(prompt) + cfg.agreement_tokens + 8, n_threads=cfg.threads,
                n_threads_batch=cfg.threads, logits_all=True, verbose=False)
    ids: list[int] = []
    logprobs: list[float] = []
    llm.eval(prompt)
    for _ in range(cfg.agreement_tokens):
        logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        token = int(np.argmax(logits))
        shifted = logits - logits.max()
        logprobs.append(float(shifted[token] - math.log(np.exp(shifted).sum())))
        ids.append(token)
        llm.eval([token])
    llm.close()
    return ids, logprobs


# =========================================================================== measurement
Sample = dict[str, float]


def measure_round(client: Any, prompts: "RoundPrompts", cfg: PeerBenchConfig) -> Sample:
    """One round of the four measurements on one server (prompts checked before each is timed)."""
    from hybridserve.bench.peer_servers import PeerClient

    assert isinstance(client, PeerClient)
    sample: Sample = {}
    for key, ids in (("cold_ttft_ms", prompts.cold), ("warm_ttft_ms", prompts.warm),
                     ("extend_ttft_ms", prompts.extend)):
        client.check_tokenization(ids)
        reply = client.complete(ids, max_tokens=1)
        _check_prompt_tokens(client.name, reply.prompt_tokens, len(ids))
        sample[key] = 1000.0 * reply.seconds
        if reply.cached_tokens is not None:
            sample[key.replace("_ms", "_cached_tokens")] = float(reply.cached_tokens)
    client.check_tokenization(prompts.decode)
    reply = client.stream(prompts.decode, cfg.decode_tokens)
    if reply.finish_reason != "length" or len(reply.chunk_times) < 2:
        raise RuntimeError(f"{client.name}: decode stopped early ({reply.finish_reason}, "
                           f"{len(reply.chunk_times)} chunks)")
    span = reply.chunk_times[-1] - reply.chunk_times[0]
    sample["decode_ms_per_token"] = 1000.0 * span / (cfg.decode_tokens - 1)
    return sample


def _check_prompt_tokens(name: str, reported: int | None, expected: int) -> None:
    if reported is not None and reported != expected:
        raise RuntimeError(f"{name} reports {reported} prompt tokens, expected {expected}")


@dataclass(frozen=True)
class RoundPrompts:
    """The prompts of one round (shared by both servers, so both see the same ids)."""

    cold: list[int]
    warm: list[int]
    extend: list[int]
    decode: list[int]


def round_prompts(source: WordPrompts, cfg: PeerBenchConfig) -> RoundPrompts:
    """Cold prompt; warm = its first `shared_tokens` + a new suffix; extend = warm + new tokens."""
    cold = source.fresh(cfg.prompt_tokens)
    warm = cold[:cfg.shared_tokens] + source.fresh(cfg.prompt_tokens - cfg.shared_tokens)
    return RoundPrompts(cold, warm, warm + source.fresh(cfg.extend_tokens), source.fresh(cfg.decode_prompt_tokens))


def alternate(clients: Sequence[Any], rounds: int, warmup: int, make_prompts: Callable[[], RoundPrompts],
              cfg: PeerBenchConfig, log: Callable[[str], None]) -> dict[str, list[Sample]]:
    """`warmup + rounds` rounds; each round both servers get the same prompts, in an order that
    flips every round. Warm-up rounds are discarded."""
    samples: dict[str, list[Sample]] = {c.name: [] for c in clients}
    for index in range(warmup + rounds):
        prompts = make_prompts()
        order = list(clients) if index % 2 == 0 else list(reversed(clients))
        for client in order:
            sample = measure_round(client, prompts, cfg)
            tag = "warm-up" if index < warmup else f"round {index - warmup + 1}/{rounds}"
            log(f"[peer] {tag} {client.name}: " + ", ".join(f"{k} {v:.1f}" for k, v in sample.items()))
            if index >= warmup:
                samples[client.name].append(sample)
    return samples


def summarize(samples: dict[str, list[Sample]]) -> dict[str, Any]:
    """Median of every metric per server and the llama.cpp / hybridserve ratio of the medians."""
    medians = {name: {key: median(s[key] for s in rows) for key in rows[0]} for name, rows in samples.items()}
    ratios = {key: medians["llama.cpp"][key] / medians["hybridserve"][key] for key in METRICS}
    return {"median": medians, "ratio_llama_cpp_over_hybridserve": ratios}


# =========================================================================== batch scaling
def batch_scaling(model_dir: Path, gguf_path: Path, prompts: list[list[int]], cfg: PeerBenchConfig,
                  extra_bufts: bool) -> dict[str, Any]:
    """Median decode step (ms) at batch 1 and at batch `len(prompts)` for each engine, run one
    after the other, and how many times batch 1's tokens/s the batch reaches."""
    steps = {"hybridserve": _hybridserve_batch_steps(model_dir, prompts, cfg),
             "llama.cpp": _in_child_process(_llama_cpp_batch_steps, gguf_path, prompts, cfg, extra_bufts)}
    size = len(prompts)
    return {"batch_size": size, **{name: {"batch_1_step_ms": 1000 * one, "batch_step_ms": 1000 * many,
                                          "speedup": size * one / many}
                                   for name, (one, many) in steps.items()}}


def _alternate_sizes(step_times: Callable[[int], list[float]], size: int, iterations: int) -> tuple[float, float]:
    """(batch-1, batch-`size`) median step seconds: one discarded warm-up of each, then the sizes
    alternated `iterations` times; each run's median over its steady steps (the first eighth
    dropped: prefill and the decode steps that follow it), then the median over the runs."""
    runs: dict[int, list[float]] = {1: [], size: []}
    for iteration in range(iterations + 1):
        for batch in (size, 1):
            times = step_times(batch)
            steady = times[len(times) // 8:]
            if iteration:
                runs[batch].append(median(steady))
    return median(runs[1]), median(runs[size])


def _hybridserve_batch_steps(model_dir: Path, prompts: list[list[int]], cfg: PeerBenchConfig) -> tuple[float, float]:
    from hybridserve.api import LLM
    from hybridserve.sampling_params import SamplingParams

    kwargs: dict[str, Any] = {"dtype": "float32", "quantization": "int8"} if cfg.dtype == "int8" \
        else {"dtype": cfg.dtype}
    llm = LLM(str(model_dir), device="cpu", num_threads=cfg.threads, kv_cache_mib=64, prefix_cache_mib=0,
              max_model_len=cfg.decode_prompt_tokens + cfg.decode_tokens + 8, **kwargs)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=cfg.decode_tokens, temperature=0.0, ignore_eos=True)
    runs = iter(range(1 << 30))

    def step_times(batch: int) -> list[float]:
        run = next(runs)
        for index, prompt in enumerate(prompts[:batch]):
            engine.add_request(f"batch-{run}-{index}", prompt, params)
        times = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step(final_only=True)
            times.append(time.perf_counter() - start)
        return times

    try:
        return _alternate_sizes(step_times, len(prompts), cfg.batch_iterations)
    finally:
        del engine, llm


def _llama_cpp_batch_steps(gguf_path: Path, prompts: list[list[int]], cfg: PeerBenchConfig,
                           extra_bufts: bool) -> tuple[float, float]:
    import llama_cpp as lib

    from hybridserve.bench.llama_cpp_launch import disable_extra_buffer_types

    if not extra_bufts:
        disable_extra_buffer_types()
    lib.llama_backend_init()
    model = lib.llama_model_load_from_file(str(gguf_path).encode(), lib.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf_path}")
    try:
        return _alternate_sizes(lambda batch: _llama_cpp_steps(lib, model, prompts[:batch], cfg), len(prompts),
                                cfg.batch_iterations)
    finally:
        lib.llama_model_free(model)


def _llama_cpp_steps(lib: Any, model: Any, prompts: list[list[int]], cfg: PeerBenchConfig) -> list[float]:
    """Seconds of each `llama_decode` call: the prompts as one batch (one sequence each), then one
    greedy token per sequence per call."""
    import numpy as np

    params = lib.llama_context_default_params()
    total = sum(len(p) for p in prompts)
    params.n_ctx = sum(len(p) + cfg.decode_tokens + 8 for p in prompts)
    params.n_batch = params.n_ubatch = max(512, total)
    params.n_seq_max = len(prompts)
    params.n_threads = params.n_threads_batch = cfg.threads
    context = lib.llama_init_from_model(model, params)
    if not context:
        raise RuntimeError("llama.cpp could not create a context")
    batch = lib.llama_batch_init(max(total, len(prompts)), 0, len(prompts))
    n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    times: list[float] = []
    try:
        rows = []  # (sequence, token, position, wants logits)
        for seq, prompt in enumerate(prompts):
            rows += [(seq, token, pos, pos == len(prompt) - 1) for pos, token in enumerate(prompt)]
        positions = [len(p) for p in prompts]
        for _ in range(cfg.decode_tokens):
            for i, (seq, token, pos, logits) in enumerate(rows):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
                batch.seq_id[i][0] = seq
            batch.n_tokens = len(rows)
            start = time.perf_counter()
            if lib.llama_decode(context, batch) != 0:
                raise RuntimeError("llama_decode failed")
            times.append(time.perf_counter() - start)
            outputs = [i for i, row in enumerate(rows) if row[3]]
            rows = []
            for seq, index in enumerate(outputs):
                logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(context, index), shape=(n_vocab,))
                rows.append((seq, int(logits.argmax()), positions[seq], True))
                positions[seq] += 1
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(context)
    return times


# =========================================================================== driver
def run_peer_bench(cfg: PeerBenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Prepare the files, check greedy agreement, start both servers, alternate the rounds."""
    from hybridserve.bench.peer_servers import LlamaCppServer, PeerClient
    from hybridserve.bench.serve_bench import ServerProcess

    if cfg.dtype == "int8" and not hybridserve_supports_quantization():
        raise RuntimeError(NEEDS_QUANTIZATION)
    _require_llama_cpp()
    load_start = os.getloadavg()
    model_dir, gguf_path = prepare_model(cfg)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    source = WordPrompts(tokenizer, cfg.seed)
    log(f"[peer] model {model_dir}, GGUF {gguf_path} ({gguf_path.stat().st_size / 2**20:.1f} MiB)")
    agreement = greedy_agreement(model_dir, gguf_path, source.fresh(32), cfg, log)
    log(f"[peer] greedy agreement: {agreement['leading_agreed']}/{cfg.agreement_tokens} leading tokens")
    eos_ids = list(tokenizer.eos_token_ids)
    with ServerProcess(serve_args(cfg, model_dir), threads=cfg.threads) as hs_server, \
            LlamaCppServer(gguf_path, threads=cfg.threads, n_ctx=cfg.n_ctx, n_batch=cfg.n_batch,
                           extra_bufts=agreement["llama_cpp_extra_bufts"]) as ll_server:
        clients = [PeerClient("hybridserve", hs_server.url, text_prompts=False, eos_ids=eos_ids),
                   PeerClient("llama.cpp", ll_server.url, text_prompts=True, eos_ids=eos_ids,
                              decode_text=source.text)]
        try:
            samples = alternate(clients, cfg.iterations, cfg.warmup, lambda: round_prompts(source, cfg), cfg, log)
        finally:
            for client in clients:
                client.close()
        argv = {"hybridserve": hs_server.argv[2:], "llama.cpp": ll_server.argv[2:]}
    scaling = None
    if cfg.batch_size:
        prompts = [source.fresh(cfg.decode_prompt_tokens) for _ in range(cfg.batch_size)]
        scaling = batch_scaling(model_dir, gguf_path, prompts, cfg, agreement["llama_cpp_extra_bufts"])
        log("[peer] batch scaling: " + ", ".join(f"{name} {scaling[name]['speedup']:.2f}x"
                                                   for name in ("hybridserve", "llama.cpp")))
    return {"config": asdict(cfg), "model_dir": str(model_dir), "gguf": str(gguf_path),
            "gguf_type": DTYPES[cfg.dtype], "servers": argv, "agreement": agreement, "samples": samples,
            **summarize(samples), "batch_scaling": scaling, "environment": _environment(load_start)}


def _require_llama_cpp() -> None:
    try:
        import llama_cpp  # noqa: F401
        import sse_starlette  # noqa: F401
        import starlette_context  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"bench peer needs llama-cpp-python and its server extras ({exc.name} is missing): "
                           "pip install -e '.[peer]' (builds llama.cpp from source, ~12 min on 2 cores)") from exc


def _environment(load_start: tuple[float, float, float]) -> dict[str, Any]:
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.machine(), "cpu_count": os.cpu_count(), "loadavg_start": list(load_start),
            "loadavg_end": list(os.getloadavg()),
            "versions": {d: version(d) for d in ("llama_cpp_python", "gguf", "torch")}}


# =========================================================================== report
_LABELS = {
    "cold_ttft_ms": "cold TTFT, {prompt} fresh tokens (ms)",
    "warm_ttft_ms": "warm TTFT, {prompt} tokens, {shared} shared, new suffix (ms)",
    "extend_ttft_ms": "warm TTFT, previous prompt + {extend} tokens (ms)",
    "decode_ms_per_token": "batch-1 decode, {decode} tokens (ms/token)",
}


def format_peer_report(result: dict[str, Any]) -> str:
    """The medians side by side with their ratio, plus the agreement and cache lines."""
    cfg = result["config"]
    medians, ratios = result["median"], result["ratio_llama_cpp_over_hybridserve"]
    rows = [[_LABELS[key].format(prompt=cfg["prompt_tokens"], shared=cfg["shared_tokens"],
                                 extend=cfg["extend_tokens"], decode=cfg["decode_tokens"]),
             f"{medians['hybridserve'][key]:.1f}", f"{medians['llama.cpp'][key]:.1f}", f"{ratios[key]:.2f}"]
            for key in METRICS]
    table = format_table(["measure", "hybridserve", "llama.cpp", "llama.cpp / hybridserve"], rows)
    agreement = result["agreement"]
    cached = medians["hybridserve"].get("warm_ttft_cached_tokens")
    lines = [f"bench peer: --dtype {cfg['dtype']} (GGUF {result['gguf_type']}), {cfg['threads']} threads each, "
             f"{cfg['iterations']} alternating rounds (medians)", table,
             f"greedy agreement (in-process, {agreement['prompt_tokens']}-token prompt): "
             f"{agreement['leading_agreed']}/{agreement['tokens']} leading tokens equal, "
             f"{agreement['same_positions']}/{agreement['tokens']} positions equal, "
             f"max |logprob diff| over the agreed tokens {agreement['max_logprob_diff']:.2g}"]
    if cached is not None:
        lines.append(f"hybridserve warm TTFT restored {cached:.0f} cached prompt tokens (median)")
    scaling = result.get("batch_scaling")
    if scaling:
        size = scaling["batch_size"]
        lines.append(f"decode step at batch {size} vs batch 1 (in-process, {cfg['batch_iterations']} alternations, "
                     "medians): " + "; ".join(
                         f"{name} {scaling[name]['batch_step_ms']:.2f} vs {scaling[name]['batch_1_step_ms']:.2f} ms, "
                         f"{size} x batch 1 / batch {size} = {scaling[name]['speedup']:.2f}x"
                         for name in ("hybridserve", "llama.cpp")))
    if agreement.get("llama_cpp_extra_bufts") is False:
        reason = (" after it crashed with them" if agreement.get("llama_cpp_crash_with_extra_bufts")
                  else " (--llama-cpp-extra-bufts off)")
        lines.append(f"llama.cpp ran without its extra buffer types (AMX / repacked weights){reason}")
    return "\n".join(lines)

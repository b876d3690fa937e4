"""Structured outputs: grammars compiled by llguidance (`GrammarCompiler`, LRU-cached) on worker
threads off the step loop, requests held back until theirs is ready (`GrammarWaitlist`, vLLM's
WAITING_FOR_FSM), and the grammars applied as token masks (docs/prefix-cache.md, Structured
outputs). llguidance drops the GIL while it builds a matcher, so a compile thread leaves the step
loop running (docs/decisions.md). Masks are filled on the calling thread and unpacked by numpy: on
a busy CPU a tiny op split across threads waits on descheduled ones."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

import llguidance
import llguidance.numpy as llg_numpy  # not llguidance.torch: it runs torch.compile at import (~5 s)
import numpy as np
import torch

from hybridserve import envs
from hybridserve.models.tokenizer import Tokenizer
from hybridserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

logger = logging.getLogger(__name__)

# Compact JSON (no free whitespace): a random or weak model cannot wander off into endless spaces.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEFAULT_CACHE_SIZE = 256
# the cache also holds at most this much constraint text: a compiled matcher grows with its grammar
# (docs/decisions.md), so many maximum-size grammars would otherwise hold far more than small ones
DEFAULT_CACHE_TEXT_BYTES = 2 << 20
COMPILE_WORKERS = 2  # compile threads: a slow grammar occupies one, the other keeps serving the rest

T = TypeVar("T")
Build = Callable[[StructuredOutputsParams], llguidance.LLMatcher]  # a constraint -> its compiled matcher


class GrammarTimeoutError(ValueError):
    """A grammar that was not compiled within the compile timeout (refused like an invalid one)."""


class CompileCacheInfo(NamedTuple):
    """Grammar compile cache counters (`compiling`: distinct grammars being compiled now;
    `text_bytes`: constraint text of the cached grammars)."""

    hits: int
    misses: int
    size: int
    compiling: int = 0
    text_bytes: int = 0


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar (JSON-wrapped) for one constraint."""
    if spec.json is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=JSON_OPTIONS)
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        alternatives = " | ".join(json.dumps(choice) for choice in spec.choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    assert spec.grammar is not None
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar)


class PendingGrammar:
    """One request's claim on a grammar being compiled (or already compiled): ready, failed, or
    past its deadline. `release` gives the claim back (a compile nobody waits for and that has not
    started is cancelled)."""

    def __init__(self, compiler: GrammarCompiler, key: str, future: concurrent.futures.Future[llguidance.LLMatcher],
                 deadline: float, claimed: bool = True) -> None:
        self.compiler = compiler
        self.key = key
        self.future = future
        self.deadline = deadline
        self._released = not claimed  # a cache hit holds no claim on a compile

    def settled(self, now: float) -> bool:
        """Whether the outcome is known: compiled, failed, or past the deadline."""
        return self.future.done() or now >= self.deadline

    def template(self, now: float) -> llguidance.LLMatcher | None:
        """The compiled matcher (shared: deep-copy it per sequence); None while compiling.
        ValueError when the grammar is invalid, `GrammarTimeoutError` past the deadline."""
        if self.future.done():
            if self.future.cancelled():
                raise GrammarTimeoutError("grammar compile was cancelled")
            return self.future.result()
        if now >= self.deadline:
            raise GrammarTimeoutError(f"grammar did not compile within {self.compiler.timeout_s:g} s "
                                      f"(the grammar compile timeout, {envs.GRAMMAR_COMPILE_TIMEOUT_S.name})")
        return None

    def compiled(self) -> llguidance.LLMatcher | None:
        """The compiled matcher if the compile already succeeded, else None (never raises)."""
        future = self.future
        if future.done() and not future.cancelled() and future.exception() is None:
            return future.result()
        return None

    def wait(self) -> llguidance.LLMatcher:
        """Block until compiled (ValueError if invalid, `GrammarTimeoutError` past the deadline)."""
        remaining = max(0.0, self.deadline - time.monotonic())
        try:
            return self.future.result(timeout=remaining)
        except concurrent.futures.TimeoutError:
            template = self.template(max(time.monotonic(), self.deadline))
            assert template is not None
            return template

    def release(self) -> None:
        """Give the claim back (idempotent)."""
        if not self._released:
            self._released = True
            self.compiler._release(self.key)


class GrammarCompiler:
    """Compiles constraints for one tokenizer on `workers` threads, with a per-constraint LRU cache
    of at most `cache_size` compiled matchers and `cache_text_bytes` of their constraint text;
    concurrent requests for one grammar share its compile.
    `build` replaces the llguidance compile (a test seam); `timeout_s` (default:
    HYBRIDSERVE_GRAMMAR_COMPILE_TIMEOUT_S) bounds how long a request waits for its grammar."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = DEFAULT_CACHE_SIZE, *,
                 workers: int = COMPILE_WORKERS, timeout_s: float | None = None, build: Build | None = None,
                 cache_text_bytes: int = DEFAULT_CACHE_TEXT_BYTES) -> None:
        self.vocab_size = vocab_size
        self.ll_tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                   eos_token=list(tokenizer.eos_token_ids))
        self.cache_size = cache_size
        self.cache_text_bytes = cache_text_bytes
        self._text_bytes = 0  # len() of the cached keys
        self.timeout_s = envs.grammar_compile_timeout_s() if timeout_s is None else timeout_s
        if not self.timeout_s > 0:
            raise ValueError(f"grammar compile timeout must be > 0 s, got {self.timeout_s}")
        self._build = build or self._compile
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="hybridserve-grammar")
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._compiling: dict[str, concurrent.futures.Future[llguidance.LLMatcher]] = {}
        self._claims: dict[str, int] = {}  # requests waiting on each grammar being compiled
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    def submit(self, spec: StructuredOutputsParams) -> PendingGrammar:
        """Start compiling `spec` (or join its compile, or take it from the cache) without waiting."""
        key = spec.key
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self._hits += 1
                future: concurrent.futures.Future[llguidance.LLMatcher] = concurrent.futures.Future()
                future.set_result(compiled)
                return PendingGrammar(self, key, future, deadline, claimed=False)
            running = self._compiling.get(key)
            if running is None:
                self._misses += 1
                running = self._pool.submit(self._compile_and_cache, key, spec)
                self._compiling[key] = running
            self._claims[key] = self._claims.get(key, 0) + 1
            return PendingGrammar(self, key, running, deadline)

    def matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for `spec`, waiting for its compile (ValueError if the grammar is invalid
        or did not compile within the timeout)."""
        pending = self.submit(spec)
        try:
            return pending.wait().deep_copy()
        finally:
            pending.release()

    def _compile_and_cache(self, key: str, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """On a compile thread: build, then cache (a failure is not cached)."""
        try:
            compiled = self._build(spec)
        except BaseException:
            with self._lock:
                self._compiling.pop(key, None)
            raise
        with self._lock:  # one lock: a concurrent `submit` finds the grammar compiling or cached
            self._compiling.pop(key, None)
            if key not in self._cache:
                self._text_bytes += len(key)
            self._cache[key] = compiled
            while len(self._cache) > 1 and (len(self._cache) > self.cache_size
                                            or self._text_bytes > self.cache_text_bytes):
                evicted, _ = self._cache.popitem(last=False)  # least recently used first
                self._text_bytes -= len(evicted)
        return compiled

    def _release(self, key: str) -> None:
        """A claim on `key` ended: with no claim left, a compile that has not started is cancelled."""
        with self._lock:
            left = self._claims.get(key, 0) - 1
            if left > 0:
                self._claims[key] = left
                return
            self._claims.pop(key, None)
            future = self._compiling.get(key)
            if future is not None and future.cancel():
                del self._compiling[key]

    def _compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        try:
            grammar = grammar_text(spec)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"invalid structured output constraint: {exc}") from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)  # drops the GIL
        if matcher.is_error():
            raise ValueError(f"invalid structured output constraint: {matcher.get_error()}")
        return matcher

    def cache_info(self) -> CompileCacheInfo:
        """Hits, misses and entries of the compile cache, and the grammars being compiled."""
        with self._lock:
            return CompileCacheInfo(self._hits, self._misses, len(self._cache), len(self._compiling),
                                    self._text_bytes)

    def close(self) -> None:
        """Stop the compile threads once their current compile ends (queued ones are cancelled)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarWaitlist(Generic[T]):
    """Items (request groups) held back from the scheduler until their grammar is compiled, keyed
    by request id; `poll` hands out the ready and the failed ones, `wait` naps until one settles."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[T, PendingGrammar]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def add(self, request_id: str, item: T, pending: PendingGrammar) -> None:
        """Hold `item` until `pending` settles."""
        self._held[request_id] = (item, pending)

    def remove(self, request_id: str) -> bool:
        """Stop holding a request (its claim on the compile is released); whether it was held."""
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        held[1].release()
        return True

    def poll(self) -> tuple[list[tuple[T, llguidance.LLMatcher]], list[tuple[T, str]]]:
        """Take out every settled item: (item, compiled matcher) for the ready, (item, error) for
        grammars that are invalid or did not compile in time."""
        now = time.monotonic()
        ready: list[tuple[T, llguidance.LLMatcher]] = []
        failed: list[tuple[T, str]] = []
        for request_id, (item, pending) in list(self._held.items()):
            if not pending.settled(now):
                continue
            del self._held[request_id]
            try:
                template = pending.template(now)
                assert template is not None
                ready.append((item, template))
            except ValueError as exc:
                failed.append((item, str(exc)))
            except Exception as exc:  # noqa: BLE001 - a compiler crash fails this request only
                logger.exception("grammar compile for request %s failed", request_id)
                failed.append((item, f"grammar compile failed: {exc}"))
            finally:
                pending.release()
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Nap up to `timeout_s`, less when a held grammar is compiled or reaches its deadline."""
        if not self._held:
            return
        pendings = [pending for _, pending in self._held.values()]
        until_deadline = min(pending.deadline for pending in pendings) - time.monotonic()
        concurrent.futures.wait([pending.future for pending in pendings],
                                timeout=max(0.0, min(timeout_s, until_deadline)),
                                return_when=concurrent.futures.FIRST_COMPLETED)


class TokenMasker:
    """Applies the matchers' allowed-token masks to a batch of logits rows."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._bitmask = llg_numpy.allocate_token_bitmask(1, vocab_size)

    def _fill(self, matchers: list[llguidance.LLMatcher]) -> np.ndarray:
        """[len(matchers), words] packed int32 bits of the tokens each matcher allows next."""
        if self._bitmask.shape[0] < len(matchers):
            self._bitmask = llg_numpy.allocate_token_bitmask(len(matchers), self.vocab_size)
        bitmask = self._bitmask[:len(matchers)]
        for row, matcher in enumerate(matchers):
            llg_numpy.fill_next_token_bitmask(matcher, bitmask, row)
        return bitmask

    def bitmask(self, matcher: llguidance.LLMatcher) -> np.ndarray:
        """A copy of the packed allowed-token bits (int32 words) of one matcher's next token."""
        row: np.ndarray = self._fill([matcher])[0].copy()
        return row

    def allowed(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """[len(matchers), vocab] bool: the tokens each matcher allows next."""
        packed = self._fill(matchers).view(np.uint8)  # little-endian words: bit i of a row is token i
        return torch.from_numpy(np.unpackbits(packed, axis=1, count=self.vocab_size, bitorder="little")).bool()

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[llguidance.LLMatcher]) -> None:
        """Set disallowed tokens of `logits[rows[i]]` to -inf, per `matchers[i]` (in place)."""
        if not rows:
            return
        index = torch.tensor(rows, device=logits.device)
        block = logits.index_select(0, index)
        apply_bitmask(block, self._fill(matchers))
        logits.index_copy_(0, index, block)


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray) -> None:
    """Set `logits[i, t]` ([n, vocab]) to -inf wherever bit t of `bitmask[i]` (packed int32 words,
    little-endian bit order) is clear, and every column past the mask's width (in place)."""
    vocab = logits.shape[-1]
    words = np.ascontiguousarray(bitmask, dtype=np.int32).view(np.uint8)
    allowed = np.unpackbits(words, axis=1, count=min(vocab, bitmask.shape[1] * 32), bitorder="little")
    width = allowed.shape[1]
    disallowed = torch.from_numpy(allowed == 0).to(logits.device)
    logits[:, :width].masked_fill_(disallowed, float("-inf"))
    logits[:, width:] = float("-inf")

"""The synchronous engine: request intake and validation, the step loop (schedule -> execute ->
apply | revert -> sample -> stop checks), outputs and stats."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from hybridserve.cache.block_pool import BlockPool, engine_block_hash
from hybridserve.cache.manager import JointCacheManager
from hybridserve.cache.policy import CachePolicy, PrefixCost, make_policy
from hybridserve.cache.snapshots import SnapshotPool
from hybridserve.cache.state_slots import StateSlotPool
from hybridserve.cache.tiers import ObjectSizes, TierStats
from hybridserve.config import EngineConfig, ModelConfig
from hybridserve.distributed.executor import TensorParallelExecutor
from hybridserve.distributed.launch import tensor_parallel_specs
from hybridserve.engine.detokenizer import IncrementalDetokenizer
from hybridserve.engine.executor import Executor, InProcessExecutor, StepFailedError, WorkerDiedError
from hybridserve.engine.memory import allocator_free_bytes
from hybridserve.engine.request import Request, RequestGroup, RequestStatus
from hybridserve.engine.runner import ModelRunner
from hybridserve.engine.sampling import SampledToken, SamplingSpec, SequenceKey, sampling_spec
from hybridserve.engine.scheduler import Scheduler, SchedulerOutput, blocks_for
from hybridserve.engine.step_plan import StepPlan, ordered_requests, plan_step
from hybridserve.engine.structured_output import GrammarCompiler, GrammarWaitlist, TokenMasker
from hybridserve.engine.threads import apply_process_settings
from hybridserve.engine.tier_mover import DeviceCachePools, EngineTierMover, build_engine_tiers, tiers_requested
from hybridserve.engine.worker import PlanResult, WorkerSpec
from hybridserve.errors import EngineDeadError, InvalidRequestError, QueueFullError
from hybridserve.layers.attention import PagedKVCache
from hybridserve.models.builtin import BUILTIN_MODEL_CONFIG, builtin_tokenizer
from hybridserve.models.loader import read_model_config, resolve_model
from hybridserve.models.tokenizer import Tokenizer
from hybridserve.routing.summary import encode_summary, hash_identity
from hybridserve.sampling_params import CompletionOutput, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)
MIB = 1 << 20
MAX_FAILED_STEPS = 3  # a request whose forward fails this many times in a row, run alone, ends with "error"
TIER_WAIT_S = 0.002    # an idle step waits this long for a lower tier's transfer instead of spinning
GRAMMAR_WAIT_S = 0.002  # likewise for a held-back request's grammar compile
GDN_CHUNK_SIZE = 64   # chunked gated-delta prefill; snapshots are taken at any position inside a chunk


class PrefixCacheReport(NamedTuple):
    """`LLM.prefix_cache_stats()`: `PrefixCacheStats`'s lookup counters, then snapshot and pool figures."""

    queries: int
    query_tokens: int
    hits: int
    hit_tokens: int
    kv_only_misses: int
    snapshot_only_misses: int
    snapshots_published: int
    snapshots_evicted: int
    snapshots_skipped: int
    snapshots_aborted: int
    resident_snapshots: int
    resident_snapshot_bytes: int
    snapshot_slots: int
    bytes_per_snapshot: int
    snapshot_pool_bytes: int = 0     # capacity of the snapshot pool
    kv_pool_bytes: int = 0           # capacity of the KV pool
    kv_used_bytes: int = 0           # KV blocks held by running requests
    kv_cached_free_bytes: int = 0    # free KV blocks that still hold a cached prefix


_STAT_NAMES = {"queries": "prefix_cache_queries", "query_tokens": "prefix_cache_query_tokens",  # stats() renames
               "hits": "prefix_cache_hits", "hit_tokens": "prefix_cache_hit_tokens",
               "resident_snapshots": "snapshot_slots_used", "resident_snapshot_bytes": "snapshot_bytes",
               "snapshot_slots": "snapshot_slots_total"}


def resolve_device(name: str) -> torch.device:
    """`auto`: CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: float32 on CPU (where bf16 matmul is far slower), bfloat16 on accelerators."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    dtype: torch.dtype = getattr(torch, name)
    return dtype


class LLMEngine:
    """Owns tokenizer, model runner and scheduler; not thread-safe (drive it from one thread)."""

    def __init__(self, config: EngineConfig) -> None:
        if config.model is not None:  # a Hub id becomes its local snapshot (ranks and stores read the path)
            config = dataclasses.replace(config, model=resolve_model(config.model))
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.num_threads = apply_process_settings(config.num_threads, self.device.type).num_threads
        self.model_config, self.tokenizer = self._load_model_config_and_tokenizer()
        self.max_model_len = config.scheduler.max_model_len or self.model_config.max_position_embeddings
        self.tensor_parallel_size = config.tensor_parallel_size
        self.dead_reason: str | None = None
        if tiers_requested(config) and config.tensor_parallel_size != 1:
            raise ValueError("lower cache tiers (--host-cache-memory, --disk-cache-dir) are not supported with "
                             f"tensor_parallel_size={config.tensor_parallel_size} yet; use tensor_parallel_size=1")
        self.executor = self._start_executor()
        self.tier_mover: EngineTierMover | None = None  # the lower cache tiers' mover, when any is on
        self.cache = self._make_cache_manager()
        self.scheduler = Scheduler(config.scheduler, self.cache)
        self.requests: dict[str, RequestGroup] = {}
        self._finished_groups: dict[str, RequestGroup] = {}  # finished this step, awaiting their output
        self._grammars: GrammarCompiler | None = None
        self._masker: TokenMasker | None = None
        # requests held back from the scheduler until their grammar is compiled (off the step loop)
        self._grammar_waits: GrammarWaitlist[RequestGroup] = GrammarWaitlist()
        # told (request id, None or the error) when a held-back request's grammar settles (the core)
        self.on_grammar_settled: Callable[[str, str | None], None] | None = None
        self._released: list[SequenceKey] = []  # sequences ended since the last plan (their generators go)
        # False in the engine core process: only requests with stop strings are detokenized here,
        # the API process detokenizes the others off the step loop (core_client.RequestStream)
        self.detokenize_all_requests = True
        logger.info("hybridserve engine: %s", self.describe())

    def _start_executor(self) -> Executor:
        """Start the workers (in this process at TP=1, else one process per rank) and take their capacity."""
        executor: Executor
        if self.tensor_parallel_size == 1:
            dtype_name = str(self.dtype).removeprefix("torch.")
            executor = InProcessExecutor(WorkerSpec(0, 1, "", self.config, self.model_config, self.max_model_len,
                                                    self.num_threads, str(self.device), dtype_name, GDN_CHUNK_SIZE))
        else:
            specs = tensor_parallel_specs(self.config, self.model_config, self.max_model_len, self.device,
                                          self.dtype, self.num_threads, GDN_CHUNK_SIZE)
            executor = TensorParallelExecutor(specs)
        capacity = executor.capacity
        self.bytes_per_snapshot = capacity.bytes_per_snapshot
        self.kv_bytes_per_block = capacity.kv_bytes_per_block
        self.weight_bytes = capacity.weight_bytes * self.tensor_parallel_size
        self.memory_plan = capacity.memory_plan
        self.num_kv_blocks, self.num_snapshot_slots = capacity.num_kv_blocks, capacity.num_snapshot_slots
        return executor

    @property
    def runner(self) -> ModelRunner:
        """The model runner of a TP=1 engine (its model and physical cache, for inspection)."""
        if not isinstance(self.executor, InProcessExecutor):
            raise AttributeError("a tensor-parallel engine's runners live in its worker processes")
        return self.executor.worker.runner

    def _make_cache_manager(self) -> JointCacheManager:
        """The joint cache manager over the device pools, with the lower tiers the flags ask for."""
        cache = self.config.cache
        block_hash = engine_block_hash(cache.block_hash, cache.block_hash_seed, cache.disk_cache_dir)
        if not tiers_requested(self.config):
            return JointCacheManager.create(cache.block_size, self.num_kv_blocks, self.config.scheduler.max_num_seqs,
                                            self.num_snapshot_slots, self._cache_policy(), block_hash)
        runner = self.runner
        if runner.snapshots is None:
            raise ValueError("lower cache tiers need the prefix cache (snapshot slots); prefix_cache_mib is 0")
        tiers, self.tier_mover = build_engine_tiers(
            self.config, model_config=self.model_config, dtype=self.dtype, device=self.device,
            tokenizer_json=self.tokenizer.backend.to_str(), weights=runner.model.state_dict(),
            pools=DeviceCachePools(runner.kv_cache, runner.snapshots),
            sizes=ObjectSizes(self.bytes_per_snapshot, self.kv_bytes_per_block))
        return JointCacheManager(cache.block_size, BlockPool(self.num_kv_blocks),
                                 StateSlotPool(self.config.scheduler.max_num_seqs),
                                 SnapshotPool(self.num_snapshot_slots), self._cache_policy(), block_hash, tiers=tiers)

    def tier_stats(self) -> list[TierStats]:
        """Hits by cache tier (the device first) and each lower tier's occupancy and transfers."""
        return self.cache.tier_stats()

    def routing_summary(self, epoch: int) -> dict[str, Any]:
        """This replica's joint boundaries as a router reads them (`hybridserve.routing.summary`):
        keyed by its block hash, tagged with `epoch` (newer replaces older at the router)."""
        return encode_summary(self.cache.joint_boundaries(), self.config.cache.block_size, epoch,
                              hash_identity(self.cache.block_hash))

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers; finish the lower tiers' queued writes and close their
        stores (the disk directory's lock goes); the engine cannot step afterwards."""
        if self._grammars is not None:
            self._grammars.close()
        if self.tier_mover is not None:
            self.tier_mover.close()
            self.tier_mover = None
            self.dead_reason = self.dead_reason or "the engine was shut down"
        if self.tensor_parallel_size > 1:
            self.executor.shutdown()
            self.dead_reason = self.dead_reason or "the engine was shut down"

    def _load_model_config_and_tokenizer(self) -> tuple[ModelConfig, Tokenizer]:
        if self.config.model is None:
            return BUILTIN_MODEL_CONFIG, builtin_tokenizer()
        model_config = read_model_config(self.config.model)
        tokenizer = Tokenizer.from_model_dir(self.config.model).with_extra_eos_token_ids(model_config.eos_token_ids)
        return model_config, tokenizer

    def _cache_policy(self) -> CachePolicy:
        """The configured admission/eviction policy, costed for this model's shape."""
        cfg, cache = self.model_config, self.config.cache
        kv_per_token = PagedKVCache.bytes_per_token(len(cfg.attention_layer_ids), cfg.num_key_value_heads,
                                                    cfg.head_dim, self.dtype)
        cost = PrefixCost.from_model(cfg, kv_per_token, self.bytes_per_snapshot)
        return make_policy(cache.cache_policy, cache.block_size, cost, cache.snapshot_interval)

    def describe(self) -> str:
        """One line with the resolved sizes (printed at start-up)."""
        cache = self.config.cache
        return (f"device={self.device} dtype={str(self.dtype).removeprefix('torch.')} "
                f"threads={self.num_threads} tensor_parallel_size={self.tensor_parallel_size} "
                f"weights={self.weight_bytes / MIB:.1f}MiB kv_pool={self.memory_plan.kv_bytes / MIB:.1f}MiB "
                f"snapshot_pool={self.memory_plan.snapshot_bytes / MIB:.1f}MiB ({self.memory_plan.source}) "
                f"max_model_len={self.max_model_len} kv_blocks={self.num_kv_blocks}x{cache.block_size} tokens "
                f"state_slots={self.config.scheduler.max_num_seqs} snapshot_slots={self.num_snapshot_slots} "
                f"bytes_per_snapshot={self.bytes_per_snapshot} cache_policy={cache.cache_policy} "
                f"snapshot_interval={cache.snapshot_interval}")

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     cache_salt: str | None = None) -> RequestGroup:
        """Validate and tokenize (ValueError on bad input) into a group of `params.n` sequences, unqueued."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        vocab = self.model_config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias token id {max(params.logit_bias)} is outside the vocabulary [0, {vocab})")
        text, token_ids = self._tokenize(prompt)
        max_tokens = self._check_lengths(len(token_ids), params)
        sequences = [self._sequence(request_id, index, text, token_ids, params, cache_salt, max_tokens)
                     for index in range(params.n)]
        return RequestGroup(request_id, sequences)

    def _sequence(self, request_id: str, index: int, text: str | None, token_ids: list[int],
                  params: SamplingParams, cache_salt: str | None, max_tokens: int) -> Request:
        request = Request(request_id, text, token_ids, params, cache_salt, index=index, max_tokens=max_tokens)
        if self.detokenize_all_requests or params.stop:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        return request

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output grammar compiler (built on first use: it indexes the vocabulary)."""
        if self._grammars is None:
            self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        assert self._grammars is not None
        return self._grammars

    @grammars.setter
    def grammars(self, compiler: GrammarCompiler) -> None:
        self._grammars = compiler
        self._masker = TokenMasker(compiler.vocab_size)

    def await_grammars(self, groups: list[RequestGroup]) -> None:
        """Compile the grammars of unqueued groups now, in parallel, and wait (ValueError for the
        first that is invalid or times out); for callers that validate a whole batch before any
        of it runs (`LLM.generate`), their `enqueue` then finds each grammar compiled."""
        specs = [group.first.params.structured_outputs for group in groups]
        pendings = [self.grammars.submit(spec) for spec in specs if spec is not None]
        try:
            for pending in pendings:
                pending.wait()
        finally:
            for pending in pendings:
                pending.release()

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    cache_salt: str | None = None) -> None:
        """Validate and queue a request (ValueError, QueueFullError, or EngineDeadError after a worker died)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self.num_waiting_requests >= self.config.scheduler.max_waiting_requests:
            raise QueueFullError(f"{self.num_waiting_requests} requests are waiting; try again later")
        self.enqueue(self.make_request(request_id, prompt, params, cache_salt))

    def enqueue(self, group: RequestGroup) -> None:
        """Queue a request built by `make_request` (its first sequence; the others fork from it).
        One with structured outputs is held back until its grammar is compiled (`awaits_grammar`)."""
        if group.request_id in self.requests:
            raise ValueError(f"request_id {group.request_id!r} is already in use")
        spec = group.first.params.structured_outputs
        if spec is None:
            self.requests[group.request_id] = group
            self.scheduler.add(group.first)
            return
        pending = self.grammars.submit(spec)
        template = pending.compiled()  # a cache hit: queued at once
        self.requests[group.request_id] = group
        if template is None:
            self._grammar_waits.add(group.request_id, group, pending)
            return
        pending.release()
        self._queue_with_grammar(group, template)

    def awaits_grammar(self, request_id: str) -> bool:
        """Whether a queued request is held back until its grammar is compiled."""
        return request_id in self._grammar_waits

    def _queue_with_grammar(self, group: RequestGroup, template: Any) -> None:
        """Give each sequence its own matcher from the compiled grammar and queue the group."""
        for request in group.sequences:
            request.matcher = template.deep_copy()
        self.scheduler.add(group.first)

    def _settle_grammars(self) -> list[RequestGroup]:
        """Queue the held-back groups whose grammar is compiled; end those whose grammar is invalid
        or timed out with "error" (returned: their output is due) and tell `on_grammar_settled`."""
        ready, failed = self._grammar_waits.poll()
        for group, template in ready:
            self._queue_with_grammar(group, template)
            if self.on_grammar_settled is not None:
                self.on_grammar_settled(group.request_id, None)
        for group, error in failed:
            logger.warning("request %s: %s", group.request_id, error)
            self._end_held(group, "error")
            self.requests.pop(group.request_id, None)
            self._finished_groups[group.request_id] = group
            if self.on_grammar_settled is not None:
                self.on_grammar_settled(group.request_id, error)
        return [group for group, _ in failed]

    def _end_held(self, group: RequestGroup, reason: str) -> None:
        """End a group that never reached the scheduler (it holds no cache resource)."""
        self._drop_unforked(group, reason)
        group.first.status, group.first.finish_reason = RequestStatus.FINISHED, reason

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        vocab = self.model_config.vocab_size
        if set(map(type, prompt)) != {int} or min(prompt) < 0 or max(prompt) >= vocab:
            bad = next(t for t in prompt if type(t) is not int or not 0 <= t < vocab)
            raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        return None, list(prompt)

    def _check_lengths(self, num_prompt: int, params: SamplingParams) -> int:
        """Check the prompt and max_tokens against the context and KV pool; max_tokens resolved."""
        if num_prompt == 0:
            raise ValueError("prompt is empty after tokenization")
        if num_prompt >= self.max_model_len:
            raise ValueError(f"prompt has {num_prompt} tokens, but the maximum context length is "
                             f"{self.max_model_len} tokens (prompt plus at least one generated token)")
        if params.max_tokens is None:
            room = min(self.max_model_len, self.num_kv_blocks * self.config.cache.block_size) - num_prompt
            if room < 1:
                raise ValueError(f"prompt ({num_prompt} tokens) leaves no room in the KV pool "
                                 f"({self.num_kv_blocks} blocks); raise kv_cache_mib")
            return room
        if num_prompt + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds the maximum "
                             f"context length of {self.max_model_len} tokens")
        needed = blocks_for(num_prompt + params.max_tokens, self.config.cache.block_size)
        if needed > self.num_kv_blocks:
            raise ValueError(f"request needs {needed} KV blocks but the KV pool has only {self.num_kv_blocks}; "
                             f"raise kv_cache_mib or lower max_tokens")
        return params.max_tokens

    def abort_request(self, request_id: str) -> None:
        """Stop a request (all its sequences) and free everything it holds; unknown ids are ignored."""
        group = self.requests.pop(request_id, None)
        if group is None:
            return
        if self._grammar_waits.remove(request_id):
            self._end_held(group, "abort")
            return
        self._drop_unforked(group, "abort")
        for request in group.sequences:
            if not request.is_finished:
                self.scheduler.finish(request, "abort")
                self._released.append((request.request_id, request.index))

    def _drop_unforked(self, group: RequestGroup, reason: str) -> None:
        """Finish sequences that never started (their parent ended before forking them)."""
        for request in group.unforked:
            request.status = RequestStatus.FINISHED
            request.finish_reason = reason
        group.unforked.clear()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._grammar_waits)

    @property
    def num_waiting_requests(self) -> int:
        """Requests queued for admission, those waiting for their grammar included."""
        return len(self.scheduler.waiting) + len(self._grammar_waits)

    @property
    def num_running_requests(self) -> int:
        return len(self.scheduler.running)

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Run one step; outputs of requests that got a new token or finished (`final_only`: finished)."""
        groups = self.step_groups()
        return [self.output(group) for group in groups if not final_only or group.is_finished]

    def step_groups(self) -> list[RequestGroup]:
        """Run one step; the groups that got a new token or finished (docs/prefix-cache.md: failures)."""
        self._finished_groups.clear()
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        refused = self._settle_grammars() if self._grammar_waits else []  # their output is due too
        groups = self._step_scheduled()
        return refused + groups if refused else groups

    def _step_scheduled(self) -> list[RequestGroup]:
        """Schedule, execute and sample one step; the groups that got a new token or finished."""
        self.cache.poll_tiers()  # settle finished tier transfers (promoted objects land on the device here)
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            if self.tier_mover is not None and self.tier_mover.busy:
                self.tier_mover.wait(TIER_WAIT_S)  # the waiting requests' state is on its way up
            elif self._grammar_waits:
                self._grammar_waits.wait(GRAMMAR_WAIT_S)  # only grammars are pending: nap, do not spin
            return []
        plan = plan_step(scheduled, self._draws, self._released)
        self._released = []
        try:
            result = self._execute(plan)
        except WorkerDiedError as exc:
            return self._after_worker_death(scheduled, str(exc))
        except StepFailedError as exc:  # every rank agreed: revert, as for any failed forward
            logger.error("step failed (%s); step reverted", exc)
            return self._after_failed_step(scheduled)
        except Exception:  # noqa: BLE001 - revert, keep serving, and fail only repeat offenders
            logger.exception("forward failed; step reverted")
            return self._after_failed_step(scheduled)
        try:
            self.scheduler.apply(scheduled, result.failed_snapshot_slots)
        except Exception:  # noqa: BLE001 - the step's requests cannot continue; the others can
            logger.exception("committing a step failed; its %d request(s) end with an error", len(scheduled.chunks))
            return self._fail_requests([chunk.request for chunk in scheduled.chunks])
        requests = ordered_requests(scheduled)
        for index, logits in result.prompt_logits:
            requests[index].prompt_logits.append(logits)
        for index, rows in result.prompt_logprobs:
            scored = requests[index].prompt_logprobs
            if scored is not None:
                scored.extend(rows)
        now = time.monotonic()
        sequences: list[Request] = []
        for index, draws in result.draws:
            targets = [requests[index], *self._fork_children(requests[index], len(draws) - 1)]
            for request, draw in zip(targets, draws):
                if request is not None:
                    sequences.append(request)
                    self._take_draw(request, draw, now)
        return self._groups(sequences)

    def _execute(self, plan: StepPlan) -> PlanResult:
        """Run one step's forward; the lower tiers' background writes wait for its end (see
        `StoreMover.hold_writes`)."""
        if self.tier_mover is None:
            return self.executor.execute(plan)
        self.tier_mover.hold_writes(True)
        try:
            return self.executor.execute(plan)
        finally:
            self.tier_mover.hold_writes(False)

    def _draws(self, request: Request) -> tuple[SamplingSpec, ...]:
        """A request's next draws: its own, then those of the sequences forked from it this step."""
        specs = [self._spec(request)]
        group = self.requests.get(request.request_id)
        if group is not None and group.unforked and request.index == 0 and not request.num_output_tokens:
            specs += [self._spec(child) for child in group.unforked]
        return tuple(specs)

    def _spec(self, request: Request) -> SamplingSpec:
        """One draw's spec; a structured-output request carries its grammar's allowed tokens."""
        if request.matcher is None or self._masker is None:
            return sampling_spec(request)
        try:
            return sampling_spec(request, self._masker.bitmask(request.matcher))
        except Exception as exc:  # noqa: BLE001 - only this draw fails
            return sampling_spec(request, error=f"grammar mask failed: {exc}")

    def _fork_children(self, parent: Request, count: int) -> list[Request | None]:
        """Fork `count` unforked sequences from `parent`; one without room is queued instead, one
        whose fork raised ends alone with "error" (None for both)."""
        group = self.requests.get(parent.request_id)
        if count <= 0 or group is None:
            return []
        children: list[Request | None] = []
        for child in group.unforked[:count]:
            try:
                children.append(self._fork_child(parent, child))
            except Exception:  # noqa: BLE001 - only this child fails; its parent and the batch go on
                logger.exception("forking sequence %d of request %s failed", child.index, child.request_id)
                self._fail_unstarted(child)
                children.append(None)
        del group.unforked[:count]
        return children

    def _fork_child(self, parent: Request, child: Request) -> Request | None:
        """Fork one child from `parent` (None: no room now, so it is queued to prefill alone later)."""
        fork = self.scheduler.fork(parent, child)
        if fork is None:
            self.scheduler.add(child)
            self._released.append((child.request_id, child.index))
            return None
        self.executor.fork(fork)
        return child

    def _fail_unstarted(self, child: Request) -> None:
        """End a child whose fork raised with "error": what the fork took is freed when it runs."""
        if child.status is RequestStatus.RUNNING:
            self._finish(child, "error", flush=False)
            return
        child.status, child.finish_reason = RequestStatus.FINISHED, "error"
        self._released.append((child.request_id, child.index))
        group = self.requests.get(child.request_id)
        if group is not None and group.is_finished:
            del self.requests[child.request_id]
            self._finished_groups[child.request_id] = group

    def _take_draw(self, request: Request, draw: SampledToken | str, now: float) -> None:
        """Accept a sampled token and apply the stop rules; "error" if the draw failed or accepting it raised."""
        if isinstance(draw, str):
            logger.error("request %s failed: %s", request.request_id, draw)
            self._finish(request, "error", flush=False)
            return
        try:
            request.append_token(draw.token_id)
            if request.logprobs is not None and draw.logprobs is not None:
                request.logprobs.append(draw.logprobs)
                request.cumulative_logprob += draw.logprobs[draw.token_id]
            if request.first_token_time is None:
                request.first_token_time = now
            self._check_stop(request)
        except Exception:  # noqa: BLE001 - e.g. the detokenizer: only this request fails
            logger.exception("request %s failed after sampling", request.request_id)
            if not request.is_finished:
                self._finish(request, "error", flush=False)

    def _fail_requests(self, requests: list[Request]) -> list[RequestGroup]:
        """End each unfinished request with "error" (freeing what it holds); their groups."""
        for request in requests:
            if not request.is_finished:
                self._finish(request, "error", flush=False)
        return self._groups(requests)

    def _groups(self, requests: list[Request]) -> list[RequestGroup]:
        """The groups these sequences belong to (running or finished this step), once each."""
        groups = {r.request_id: group for r in requests
                  if (group := self.requests.get(r.request_id) or self._finished_groups.get(r.request_id))}
        return list(groups.values())

    def _after_worker_death(self, scheduled: SchedulerOutput, reason: str) -> list[RequestGroup]:
        """A worker died: revert the step, end every request with "error" and mark the engine dead."""
        logger.error("tensor-parallel worker failure: %s; failing %d request(s)", reason, len(self.requests))
        self.dead_reason = f"tensor-parallel worker failure: {reason}"
        self.scheduler.revert(scheduled)
        sequences = [r for group in list(self.requests.values()) for r in group.sequences
                     if not r.is_finished and r not in group.unforked]
        return self._fail_requests(sequences)

    def _after_failed_step(self, scheduled: SchedulerOutput) -> list[RequestGroup]:
        """Revert the step; a request in MAX_FAILED_STEPS failed steps in a row ends with "error"."""
        self.scheduler.revert(scheduled)
        failing = [chunk.request for chunk in scheduled.chunks
                   if chunk.request.failed_steps >= MAX_FAILED_STEPS and not chunk.request.is_finished]
        for request in failing:
            self._finish(request, "error")
        return self._groups(failing)

    def _check_stop(self, request: Request) -> None:
        params, token = request.params, request.output_token_ids[-1]
        detokenizer, delta = request.detokenizer, ""
        if detokenizer is not None:
            delta = detokenizer.update(request.output_token_ids)
            request.output_text = detokenizer.text
        enough = request.num_output_tokens >= params.min_tokens
        if enough and not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            return self._finish(request, "stop")
        if request.matcher is not None:
            if not request.matcher.consume_token(token):
                logger.warning("request %s: grammar rejected token %d (%s)", request.request_id, token,
                               request.matcher.get_error())
                return self._finish(request, "error")
            if request.matcher.is_stopped():  # the grammar is complete: only EOS could follow
                return self._finish(request, "stop")
        if enough and params.stop_token_ids and token in params.stop_token_ids:
            return self._finish(request, "stop", token)
        if enough and isinstance(params.stop, list) and params.stop and delta and detokenizer is not None:
            hit = _find_stop(detokenizer.text, params.stop, since=len(detokenizer.text) - len(delta))
            if hit is not None:
                index, stop = hit
                end = index + len(stop) if params.include_stop_str_in_output else index
                request.output_text = detokenizer.text[:end]
                return self._finish(request, "stop", stop, flush=False)
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return self._finish(request, "length")
        return None

    def _finish(self, request: Request, reason: str, stop_reason: str | int | None = None,
                flush: bool = True) -> None:
        if flush and request.detokenizer is not None:
            request.detokenizer.finish(request.output_token_ids)
            request.output_text = request.detokenizer.text
        capture = self.scheduler.finish(request, reason)
        self._released.append((request.request_id, request.index))
        if capture is not None:
            copied = self.executor.save_state(capture.state_slot, capture.reservation.slot)
            self.scheduler.complete_end_capture(capture, copied)
        request.stop_reason = stop_reason
        group = self.requests.get(request.request_id)
        if group is None:
            return
        if request.index == 0 and group.unforked:
            self._drop_unforked(group, reason)  # e.g. the prompt failed: its forks cannot start
        if group.is_finished:
            del self.requests[request.request_id]
            self._finished_groups[request.request_id] = group

    def output(self, group: RequestGroup) -> RequestOutput:
        """The `RequestOutput` of a group as it stands (a copy: later steps do not change it)."""
        first = group.first
        metrics = {"arrival_time": first.arrival_time}
        first_tokens = [s.first_token_time for s in group.sequences if s.first_token_time is not None]
        if first_tokens:
            metrics["first_token_time"] = min(first_tokens)
        outputs = [CompletionOutput(
            index=s.index, text=s.output_text, token_ids=list(s.output_token_ids),
            cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
            logprobs=list(s.logprobs) if s.logprobs is not None else None,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason) for s in group.sequences]
        return RequestOutput(
            request_id=group.request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=outputs, finished=group.is_finished, num_cached_tokens=first.num_cached_tokens or 0,
            metrics=metrics, prompt_logprobs=None if first.prompt_logprobs is None else list(first.prompt_logprobs))

    def prompt_logits(self, prompt: str | list[int], cache_salt: str | None = None) -> torch.Tensor:
        """Logits [n, vocab] of every computed prompt position (n = length - prefix hit); steps until done."""
        group = self.make_request(f"prompt-logits-{id(prompt)}-{time.monotonic_ns()}", prompt,
                                  SamplingParams(max_tokens=1, temperature=0.0), cache_salt)
        request = group.first
        request.keep_prompt_logits = True
        self.enqueue(group)
        while not request.is_finished:
            self.step()
        return torch.cat(request.prompt_logits)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_tiers: bool = False) -> bool:
        """Forget every cached prefix, as vLLM's `reset_prefix_cache` does (`JointCacheManager.
        reset_prefix_cache`): later requests compute their prompts whole until the cache fills again.
        While requests run it changes nothing and returns False, unless `reset_running_requests`:
        then they are preempted first and recompute their tokens. `reset_tiers` empties the host and
        disk tiers too (a shared remote tier is only forgotten: other replicas use its store)."""
        for name, value in (("reset_running_requests", reset_running_requests), ("reset_tiers", reset_tiers)):
            if not isinstance(value, bool):
                raise InvalidRequestError(f"reset_prefix_cache: {name} must be true or false, got {value!r}")
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self.scheduler.running:
            if not reset_running_requests:
                return False
            self.scheduler.preempt_all()
        self.cache.poll_tiers()  # settle what landed, so a finished promotion is not left behind
        return self.cache.reset_prefix_cache(lower_tiers=reset_tiers)

    def prefix_cache_stats(self) -> PrefixCacheReport:
        """Joint prefix cache counters (all zero when the cache is disabled)."""
        lookup, snap, usage = self.cache.prefix_stats(), self.cache.snapshot_stats(), self.cache.usage()
        return PrefixCacheReport(
            *lookup, snapshots_published=snap.published_total, snapshots_evicted=snap.evicted_total,
            snapshots_skipped=snap.skipped_total, snapshots_aborted=snap.aborted_total,
            resident_snapshots=snap.published, resident_snapshot_bytes=snap.published * self.bytes_per_snapshot,
            snapshot_slots=self.num_snapshot_slots, bytes_per_snapshot=self.bytes_per_snapshot,
            snapshot_pool_bytes=self.num_snapshot_slots * self.bytes_per_snapshot,
            kv_pool_bytes=self.num_kv_blocks * self.kv_bytes_per_block,
            kv_used_bytes=usage.kv_blocks_used * self.kv_bytes_per_block,
            kv_cached_free_bytes=usage.kv_blocks_cached_free * self.kv_bytes_per_block)

    def stats(self) -> dict[str, float]:
        """Flat gauges and counters for metrics endpoints (`PrefixCacheReport`'s, some renamed)."""
        usage = self.cache.usage()
        report = {_STAT_NAMES.get(name, name): value for name, value in self.prefix_cache_stats()._asdict().items()}
        return {
            **report, "kv_blocks_total": usage.kv_blocks, "kv_blocks_used": usage.kv_blocks_used,
            "kv_blocks_cached_free": usage.kv_blocks_cached_free, "kv_blocks_free": usage.kv_blocks_free,
            "state_slots_total": usage.state_slots, "state_slots_free": usage.state_slots_free,
            "num_running": self.num_running_requests, "num_waiting": self.num_waiting_requests,
            "num_preemptions": self.scheduler.num_preemptions, "weight_bytes": self.weight_bytes,
            "heap_free_bytes": allocator_free_bytes() if self.device.type == "cpu" else 0,
            "snapshots_reserved": usage.snapshots_reserved, "snapshots_pinned": usage.snapshots_pinned,
            **self._tier_gauges(),
        }

    def _tier_gauges(self) -> dict[str, float]:
        """`tier_<name>_<counter>` per lower tier (none without tiers): `TierStats` fields."""
        if self.tier_mover is None:
            return {}
        return {f"tier_{tier.name}_{name}": value for tier in self.tier_stats()[1:]
                for name, value in tier._asdict().items() if name != "name"}

    def check_integrity(self) -> None:
        """Assert pool accounting is consistent; when idle, every block and slot is free again."""
        self.scheduler.check_integrity()
        if self.tier_mover is not None:
            self.tier_mover.check_stores()
        if not self.has_unfinished_requests():
            usage = self.cache.usage()
            assert usage.kv_blocks_free == usage.kv_blocks, "KV blocks still in use while idle"
            assert usage.state_slots_free == usage.state_slots, "state slots still in use while idle"
            assert usage.snapshots_reserved == 0, "snapshot reservation left open"
            assert usage.snapshots_pinned == 0, "snapshot pin left behind"


def _find_stop(text: str, stops: list[str], since: int = 0) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string in `text` that ends after position `since`."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, since - len(stop) + 1))
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop)
    return best

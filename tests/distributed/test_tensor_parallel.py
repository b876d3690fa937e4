"""Tensor parallelism on CPU (gloo, activations all-reduced through shared memory): TP=2 must
match TP=1 token for token, with the joint prefix cache.

Spawning a TP=2 engine costs seconds (two processes import torch), so each model gets one
module-scoped TP=2 engine. The worker-kill test ends the text-checkpoint engine and therefore
runs last in this file.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.distributed import launch, shm_allreduce
from hybridserve.distributed import worker as worker_process
from hybridserve.distributed.executor import TensorParallelExecutor
from hybridserve.engine.engine import EngineDeadError, LLMEngine
from hybridserve.engine.executor import InProcessExecutor
from hybridserve.engine.worker import PlanResult, Worker
from tests.helpers.targets import CPU

MIB = 1 << 20
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
PROMPTS = ["The joint prefix cache", "A hybrid model of the world keeps two kinds of state", "x" * 300]


def _tokens(length: int, seed: int) -> list[int]:
    return torch.randint(0, 4096, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _pair(model: str | None, snapshot_slots: int | None = None, **kwargs) -> tuple[LLM, LLM]:
    """A TP=1 and a TP=2 engine with the same number of snapshot slots (TP=2 ranks hold half a
    snapshot each, so they get half the snapshot memory per rank)."""
    kwargs = {"kv_cache_mib": 16, **CPU.engine_kwargs(), **kwargs}
    if snapshot_slots is None:
        return LLM(model, prefix_cache_mib=16, **kwargs), LLM(model, prefix_cache_mib=8, tensor_parallel_size=2,
                                                               **kwargs)
    probe = LLM(model, prefix_cache_mib=0, **kwargs)
    per_slot = probe.llm_engine.bytes_per_snapshot
    one = LLM(model, prefix_cache_mib=(snapshot_slots + 0.5) * per_slot / MIB, **kwargs)
    two = LLM(model, prefix_cache_mib=(snapshot_slots + 0.5) * per_slot / 2 / MIB, tensor_parallel_size=2, **kwargs)
    assert one.llm_engine.num_snapshot_slots == two.llm_engine.num_snapshot_slots == snapshot_slots
    return one, two


def _same(a, b) -> None:
    """Identical tokens and cached-token counts; logprobs within the CPU logit tolerance."""
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert a.num_cached_tokens == b.num_cached_tokens
    for x, y in zip(a.outputs, b.outputs):
        for lx, ly in zip(x.logprobs or [], y.logprobs or []):
            assert abs(lx[next(iter(lx))] - ly[next(iter(ly))]) < CPU.logit_atol


def _idle(*llms: LLM) -> None:
    for llm in llms:
        llm.llm_engine.check_integrity()


@pytest.fixture(scope="module")
def builtin_pair():
    one, two = _pair(None)
    yield one, two
    two.llm_engine.shutdown()


@pytest.fixture(scope="module")
def text_pair(text_checkpoint: Path):
    one, two = _pair(str(text_checkpoint), snapshot_slots=2, cache_policy="interval")
    yield one, two
    two.llm_engine.shutdown()


def test_builtin_greedy_tokens_and_prompt_logits_match(builtin_pair) -> None:
    one, two = builtin_pair
    # same-host CPU ranks use shared memory wherever this host allows it (a compiler, a writable /dev/shm)
    usable = shm_allreduce._local_obstacle(torch.device("cpu")) is None
    assert two.llm_engine.executor.capacity.all_reduce == ("shm" if usable else "gloo")
    for a, b in zip(one.generate(PROMPTS, GREEDY, use_tqdm=False), two.generate(PROMPTS, GREEDY, use_tqdm=False)):
        _same(a, b)
    diff = (one.llm_engine.prompt_logits("Logits of every position") -
            two.llm_engine.prompt_logits("Logits of every position")).abs().max().item()
    assert diff < CPU.logit_atol
    sampled = SamplingParams(n=2, max_tokens=6, temperature=0.8, seed=3)  # forks copy state on every rank
    for a, b in zip(one.generate(PROMPTS, sampled, use_tqdm=False), two.generate(PROMPTS, sampled, use_tqdm=False)):
        _same(a, b)
    _idle(one, two)


def test_one_worker_class_samples_where_the_logits_are(builtin_pair) -> None:
    """TP=1 holds in-process the same `Worker` that each TP rank's process runs, and a step's
    answer carries sampled token ids (and asked logprobs), never the logits."""
    one, two = builtin_pair
    assert isinstance(one.llm_engine.executor, InProcessExecutor) and type(one.llm_engine.executor.worker) is Worker
    assert isinstance(two.llm_engine.executor, TensorParallelExecutor)
    assert "logits" not in PlanResult._fields
    assert worker_process.Worker is Worker  # what every rank's process builds


def test_builtin_warm_request_and_salt_match(builtin_pair) -> None:
    one, two = builtin_pair
    prompt = _tokens(300, seed=5)
    for _ in range(2):
        a, b = one.generate([prompt], GREEDY, use_tqdm=False)[0], two.generate([prompt], GREEDY, use_tqdm=False)[0]
        _same(a, b)
    assert b.num_cached_tokens > 0
    salted = [llm.generate([prompt], GREEDY, cache_salt="tenant-b", use_tqdm=False)[0] for llm in (one, two)]
    _same(*salted)
    assert salted[1].num_cached_tokens == 0
    _idle(one, two)


def test_injected_snapshot_failure_on_one_rank_aborts_the_publish(builtin_pair) -> None:
    _, two = builtin_pair
    engine = two.llm_engine
    prompt = _tokens(290, seed=6)
    before = two.prefix_cache_stats()
    engine.executor.inject_snapshot_fault(rank=1)
    try:
        cold = two.generate([prompt], GREEDY, use_tqdm=False)[0]
    finally:
        engine.executor.inject_snapshot_fault(rank=1, fail=False)
    after = two.prefix_cache_stats()
    assert after.snapshots_aborted > before.snapshots_aborted
    assert after.snapshots_published == before.snapshots_published
    again = two.generate([prompt], GREEDY, use_tqdm=False)[0]  # misses cleanly, same output
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == cold.outputs[0].token_ids
    assert two.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens > 0  # now it was published
    _idle(two)


def test_invalid_plans_are_rejected_before_any_process_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    running = set(multiprocessing.active_children())  # the module's engines
    cases = {3: "does not divide", 16: "larger than the model's", 0: "positive integer"}
    for size, message in cases.items():
        with pytest.raises(ValueError, match=message):
            LLM(tensor_parallel_size=size, kv_cache_mib=4, prefix_cache_mib=4, **CPU.engine_kwargs())
    monkeypatch.setattr(launch, "available_cores", lambda: 1)
    with pytest.raises(ValueError, match="CPU cores"):
        LLM(tensor_parallel_size=2, kv_cache_mib=4, prefix_cache_mib=4, **CPU.engine_kwargs())
    assert set(multiprocessing.active_children()) == running


def test_checkpoint_greedy_tokens_match(text_pair) -> None:
    one, two = text_pair
    prompts = [_tokens(n, seed=n) for n in (5, 40, 257)]
    for a, b in zip(one.generate(prompts, GREEDY, use_tqdm=False), two.generate(prompts, GREEDY, use_tqdm=False)):
        _same(a, b)
    prompt = _tokens(70, seed=8)
    diff = (one.llm_engine.prompt_logits(prompt) - two.llm_engine.prompt_logits(prompt)).abs().max().item()
    assert diff < CPU.logit_atol
    _idle(one, two)


def test_checkpoint_eviction_and_all_pinned_match(text_pair) -> None:
    one, two = text_pair
    a, b, c = (_tokens(257, seed=s) for s in (10, 11, 12))
    for prompt in (a, b, a, c, a, b):  # two slots: C evicts B, then B misses
        _same(one.generate([prompt], GREEDY, use_tqdm=False)[0], two.generate([prompt], GREEDY, use_tqdm=False)[0])
    assert two.prefix_cache_stats().snapshots_evicted >= 1
    for llm in (one, two):  # every slot pinned: the next insertion is skipped
        snapshots = llm.llm_engine.cache.snapshots
        pinned = list(snapshots.evictable())
        assert len(pinned) == snapshots.num_slots
        for slot in pinned:
            snapshots.pin(slot)
        skipped = llm.prefix_cache_stats().snapshots_skipped
        llm.generate([_tokens(257, seed=13)], GREEDY, use_tqdm=False)
        assert llm.prefix_cache_stats().snapshots_skipped > skipped
        for slot in pinned:
            snapshots.unpin(slot)
    assert one.prefix_cache_stats()[:10] == two.prefix_cache_stats()[:10]
    _idle(one, two)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split()[2] == "Z" if os.path.exists(f"/proc/{pid}/stat") else False


def test_worker_killed_mid_request_fails_requests_and_stops_cleanly(text_pair) -> None:
    """Runs last: it ends the module's TP=2 checkpoint engine."""
    _, two = text_pair
    engine = two.llm_engine
    pids = engine.executor.pids
    engine.add_request("victim", _tokens(50, seed=9), SamplingParams(max_tokens=400, ignore_eos=True))
    engine.add_request("bystander", _tokens(30, seed=10), SamplingParams(max_tokens=400, ignore_eos=True))
    for _ in range(3):
        engine.step()
    os.kill(pids[1], signal.SIGKILL)
    deadline, finished = time.monotonic() + 60, {}  # the deadline only bounds a hang
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].finish_reason
    assert not engine.has_unfinished_requests(), "the requests did not finish after the worker died"
    assert finished == {"victim": "error", "bystander": "error"}
    assert engine.dead_reason is not None and "worker" in engine.dead_reason
    engine.check_integrity()
    with pytest.raises(EngineDeadError):
        engine.add_request("late", [1, 2, 3], GREEDY)
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def test_a_script_that_never_shuts_the_engine_down_still_exits(tmp_path: Path) -> None:
    """Workers are not daemons: without the executor's exit hook, multiprocessing's exit handler
    would wait for them forever while they wait for the next command."""
    import subprocess
    import sys

    script = tmp_path / "leave.py"
    script.write_text("from hybridserve import LLM\n"
                      "if __name__ == '__main__':\n"
                      "    llm = LLM(tensor_parallel_size=2, kv_cache_mib=16, prefix_cache_mib=8)\n"
                      "    print(*llm.llm_engine.executor.pids, flush=True)\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    pids = [int(pid) for pid in run.stdout.split()]
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids)


@pytest.mark.slow
def test_multimodal_checkpoint_greedy_tokens_match(multimodal_checkpoint: Path) -> None:
    one, two = _pair(str(multimodal_checkpoint))
    try:
        prompts = [_tokens(n, seed=n) for n in (7, 90)]
        for a, b in zip(one.generate(prompts, GREEDY, use_tqdm=False), two.generate(prompts, GREEDY, use_tqdm=False)):
            _same(a, b)
        _idle(one, two)
    finally:
        two.llm_engine.shutdown()


def _dying_engine() -> LLMEngine:
    """A TP=1 engine whose first step finds a worker dead (as a tensor-parallel step would)."""
    from hybridserve.engine.executor import WorkerDiedError

    engine = LLM(None, kv_cache_mib=16, prefix_cache_mib=0, **CPU.engine_kwargs()).llm_engine

    def dead_worker(plan: object) -> PlanResult:
        raise WorkerDiedError("worker hybridserve-tp1 exited with code -9")

    engine.executor.execute = dead_worker  # type: ignore[method-assign]
    return engine


def test_server_answers_503_after_a_worker_died() -> None:
    import asyncio

    import httpx

    from hybridserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
    from hybridserve.server.app import build_app

    async def scenario() -> None:
        engine = AsyncLLMEngine(_dying_engine())
        app = build_app(engine, model_name="m")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            outputs = [o async for o in engine.generate("r1", [1, 2], GREEDY)]
            assert outputs[-1].outputs[0].finish_reason == "error"
            for _ in range(100):
                if not engine.is_running:
                    break
                await asyncio.sleep(0.01)
            health = await http.get("/health")
            assert health.status_code == 503 and "exited with code -9" in health.text
            with pytest.raises(EngineDeadError):
                await engine.add_request("r2", [1, 2], GREEDY)
            reply = await http.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
            assert reply.status_code == 503
        engine.shutdown()

    asyncio.run(scenario())


@pytest.mark.slow
def test_kv_heads_replicated_when_ranks_exceed_them(tmp_path: Path) -> None:
    from tests.helpers.checkpoints import make_text_checkpoint

    path = make_text_checkpoint(tmp_path / "one_kv_head", seed=4, kv_heads=1)  # 2 ranks, 1 KV head each copy
    one, two = _pair(str(path))
    try:
        prompts = [_tokens(n, seed=n) for n in (9, 130)]
        for a, b in zip(one.generate(prompts, GREEDY, use_tqdm=False), two.generate(prompts, GREEDY, use_tqdm=False)):
            _same(a, b)
        _idle(one, two)
    finally:
        two.llm_engine.shutdown()


@pytest.mark.slow
def test_torchrun_environment_gives_the_same_tokens(tmp_path: Path) -> None:
    """The multi-node path (RANK/WORLD_SIZE/MASTER_* from torchrun), on one machine: rank 0's
    process serves, rank 1's process becomes its worker."""
    import subprocess
    import sys

    bin_dir = Path(sys.executable).parent
    command = ["generate", "-tp", "2", "--prompt", PROMPTS[1], "--max-tokens", "8", "--kv-cache-mib", "16",
               "--prefix-cache-mib", "8", "--device", CPU.device, "--dtype", CPU.dtype]
    run = subprocess.run([str(bin_dir / "torchrun"), "--nnodes", "1", "--nproc-per-node", "2", "--master-port",
                          "29641", str(bin_dir / "hybridserve"), *command],
                         capture_output=True, text=True, timeout=300, check=True)
    expected = LLM(kv_cache_mib=16, prefix_cache_mib=16, **CPU.engine_kwargs()).generate(
        [PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)[0].outputs[0].text
    assert PROMPTS[1] + expected in run.stdout

"""Fault isolation: a failure attributable to one request ends only that request; failures
outside the forward (schedule, apply) stay inside the step transaction; prefix-cache stats count
each request's admission once across reverts and preemptions. CPU, float32."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hybridserve.cache.manager import JointCacheManager
from hybridserve.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridserve.engine import engine as engine_module
from hybridserve.engine import sampling as sampling_module
from hybridserve.engine.engine import LLMEngine
from hybridserve.engine.runner import ForwardResult, ModelRunner
from hybridserve.engine.step_plan import PlanChunk, StepPlan
from hybridserve.sampling_params import RequestOutput, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)


def _engine(path: Path, *, kv_cache_mib: float = 16, prefix_cache_mib: float = 8, **scheduler) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32",
                                  cache=CacheConfig(kv_cache_mib=kv_cache_mib, prefix_cache_mib=prefix_cache_mib,
                                                    snapshot_interval=32),
                                  scheduler=SchedulerConfig(**scheduler)))


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(300, 4096, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams = GREEDY
         ) -> dict[str, RequestOutput]:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        engine.check_integrity()
    engine.check_integrity()
    return finished


PROMPTS = {f"r{i}": _prompt(20 + 9 * i, seed=i) for i in range(8)}


@pytest.fixture(scope="module")
def reference(text_checkpoint: Path) -> dict[str, RequestOutput]:
    """The eight requests served together without any fault."""
    return _run(_engine(text_checkpoint), PROMPTS)


def _assert_only_victim_failed(finished: dict[str, RequestOutput], reference: dict[str, RequestOutput],
                               victim: str) -> None:
    assert finished[victim].outputs[0].finish_reason == "error"
    for request_id, ref in reference.items():
        if request_id != victim:
            assert finished[request_id].outputs[0].finish_reason == "length"
            assert finished[request_id].outputs[0].token_ids == ref.outputs[0].token_ids, request_id


def _poison_draws(monkeypatch: pytest.MonkeyPatch, chosen: Callable[[StepPlan, PlanChunk, int], bool],
                  value: float) -> dict:
    """Make the forward's logits row of every sampling chunk for which `chosen(plan, chunk, n)`
    holds (n: how many draws its sequence had before) carry `value`: at token 17 for NaN, over
    the whole row otherwise."""
    original = ModelRunner.execute_plan
    seen: dict[tuple, int] = {}
    poisoned = {"steps": 0}

    def poison(self: ModelRunner, plan: StepPlan, restored: bool = False) -> ForwardResult:
        result = original(self, plan, restored)
        logits = result.logits.clone()
        for row, index in enumerate(result.sample_chunks):
            chunk = plan.chunks[index]
            key = chunk.sampling[0].key
            if chosen(plan, chunk, seen.get(key, 0)):
                if math.isnan(value):
                    logits[row, 17] = value
                else:
                    logits[row] = value
                poisoned["steps"] += 1
            seen[key] = seen.get(key, 0) + 1
        return result._replace(logits=logits)

    monkeypatch.setattr(ModelRunner, "execute_plan", poison)
    return poisoned


def test_nan_logits_end_only_that_request(text_checkpoint: Path, reference: dict[str, RequestOutput],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(text_checkpoint)
    poisoned = _poison_draws(monkeypatch, lambda plan, chunk, n: chunk.sampling[0].key[0] == "r5" and n == 4,
                             float("nan"))
    finished = _run(engine, PROMPTS)
    assert poisoned["steps"] == 1
    _assert_only_victim_failed(finished, reference, "r5")
    assert len(finished["r5"].outputs[0].token_ids) == 4


def test_sampler_error_ends_only_that_request(text_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = _run(_engine(text_checkpoint), PROMPTS, SAMPLED)
    original = sampling_module._sample_row
    draws = {"r2": 0}

    def flaky_row(row: torch.Tensor, spec, generator) -> int:
        if spec.key[0] == "r2":
            draws["r2"] += 1
            if draws["r2"] == 4:
                raise RuntimeError("injected sampler failure")
        return original(row, spec, generator)

    monkeypatch.setattr(sampling_module, "_sample_row", flaky_row)
    finished = _run(_engine(text_checkpoint), PROMPTS, SAMPLED)
    _assert_only_victim_failed(finished, reference, "r2")
    assert len(finished["r2"].outputs[0].token_ids) == 3


def test_detokenizer_error_ends_only_that_request(text_checkpoint: Path, reference: dict[str, RequestOutput],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(text_checkpoint)
    original = engine_module.IncrementalDetokenizer.update

    def flaky_update(self, token_ids: list[int]) -> str:
        if token_ids and token_ids == reference["r0"].outputs[0].token_ids[:6]:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer failure")
        return original(self, token_ids)

    monkeypatch.setattr(engine_module.IncrementalDetokenizer, "update", flaky_update)
    finished = _run(engine, PROMPTS)
    _assert_only_victim_failed(finished, reference, "r0")


def test_apply_failure_leaves_no_leak(text_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """apply raises midway through a step that holds a snapshot pin and open reservations: the
    step's requests end with "error", every pin/reservation/block/slot comes back, and the engine
    keeps serving (also a request that arrives afterwards)."""
    engine = _engine(text_checkpoint, max_num_batched_tokens=512)
    shared = _prompt(100, seed=50)
    _run(engine, {"warm": shared})  # publishes snapshots at 32, 64, 96
    original = JointCacheManager._register_full_blocks
    state = {"armed": True, "saw_pin": False, "saw_reservation": False}

    def failing(self: JointCacheManager, request) -> None:
        if state["armed"] and request.request_id == "hit":
            state["armed"] = False
            state["saw_pin"] = self.snapshots.num_pinned > 0 or state["saw_pin"]
            state["saw_reservation"] = self.snapshots.num_reserved > 0
            raise RuntimeError("injected apply failure")
        original(self, request)

    monkeypatch.setattr(JointCacheManager, "_register_full_blocks", failing)
    # "hit" restores the 96-token snapshot (a pin) and reserves a capture at 128.
    finished = _run(engine, {"hit": shared + _prompt(60, seed=51), "other": _prompt(70, seed=52)})
    assert not state["armed"] and state["saw_reservation"]
    assert finished["hit"].outputs[0].finish_reason == "error"
    assert finished["other"].outputs[0].finish_reason in ("error", "length")  # it may share the failed step
    snapshots = engine.cache.snapshots
    assert snapshots.num_pinned == 0 and snapshots.num_reserved == 0
    after = _run(engine, {"later": shared + _prompt(30, seed=53)})
    assert after["later"].outputs[0].finish_reason == "length" and after["later"].num_cached_tokens == 96


def test_schedule_failure_gives_back_what_it_took(text_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure while reserving snapshot slots, after blocks, a state slot and a pin were taken
    for admissions: everything is given back, the requests wait again, the error propagates."""
    engine = _engine(text_checkpoint, max_num_batched_tokens=512)
    shared = _prompt(70, seed=60)
    _run(engine, {"warm": shared})
    pool = engine.cache.snapshots
    original = type(pool).reserve
    calls = {"n": 0}

    def failing_reserve(self, key, num_tokens, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected schedule failure")
        return original(self, key, num_tokens, *args, **kwargs)

    monkeypatch.setattr(type(pool), "reserve", failing_reserve)
    engine.add_request("a", shared + _prompt(50, seed=61), GREEDY)
    engine.add_request("b", _prompt(90, seed=62), GREEDY)
    with pytest.raises(RuntimeError, match="injected schedule failure"):
        engine.step()
    engine.check_integrity()
    assert engine.num_running_requests == 0 and engine.num_waiting_requests == 2
    assert pool.num_pinned == 0 and pool.num_reserved == 0
    assert engine.prefix_cache_stats().queries == 1  # only "warm": a reverted admission is not counted
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert {o.outputs[0].finish_reason for o in finished.values()} == {"length"}
    assert finished["a"].num_cached_tokens == 64
    engine.check_integrity()


def test_stats_count_each_admission_once_across_preemption(text_checkpoint: Path) -> None:
    """A KV pool too small for all requests preempts and re-admits some; each request is still
    one query, and a forward failure (revert + re-admission) does not count again either."""
    engine = _engine(text_checkpoint, kv_cache_mib=16 * 4 / 1024)
    prompts = {f"p{i}": _prompt(60, seed=70 + i) for i in range(6)}
    _run(engine, prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    stats = engine.prefix_cache_stats()
    assert stats.queries == len(prompts)
    assert stats.query_tokens == sum(len(p) for p in prompts.values())


def test_stats_count_once_across_a_reverted_step(text_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(text_checkpoint)
    original = ModelRunner.execute_plan
    calls = {"n": 0}

    def flaky(self: ModelRunner, plan: StepPlan, restored: bool = False) -> ForwardResult:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected forward failure")
        return original(self, plan, restored)

    monkeypatch.setattr(ModelRunner, "execute_plan", flaky)
    finished = _run(engine, {"x": _prompt(50, seed=80), "y": _prompt(40, seed=81)})
    assert calls["n"] > 1 and {o.outputs[0].finish_reason for o in finished.values()} == {"length"}
    assert engine.prefix_cache_stats().queries == 2


def test_stream_of_a_failed_request_carries_an_error_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over HTTP: the poisoned stream ends with finish_reason "error" and an error event in the
    OpenAI envelope before [DONE]; a concurrent stream finishes normally."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from hybridserve.engine.async_engine import AsyncLLMEngine
    from hybridserve.server.app import build_app
    from tests.helpers.live_server import ServerThread

    poison_token = 4095
    victims: set[int] = set()  # the poisoned request's live state slot
    fired: list[int] = []  # once poisoned, never again: the good request may reuse the slot later

    def chosen(plan: StepPlan, chunk: PlanChunk, draws: int) -> bool:
        victims.update(c.state_slot for c in plan.chunks if c.start == 0 and c.token_ids[0] == poison_token)
        hit = not fired and chunk.state_slot in victims and draws == 2
        if hit:
            fired.append(chunk.state_slot)
        return hit

    _poison_draws(monkeypatch, chosen, float("inf"))
    config = EngineConfig(device="cpu", dtype="float32", cache=CacheConfig(kv_cache_mib=16, prefix_cache_mib=0))
    engine = AsyncLLMEngine(LLMEngine(config), max_waiting_requests=8)

    def stream(url: str, first_token: int) -> list[str]:
        body = {"prompt": [first_token] + _prompt(20, seed=first_token), "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]

    try:
        with ServerThread(build_app(engine, model_name="tiny")) as server:
            with ThreadPoolExecutor(2) as pool:
                bad, good = pool.map(lambda t: stream(server.url, t), [poison_token, 300])
    finally:
        engine.shutdown()
    assert bad[-1] == good[-1] == "[DONE]"
    bad_events = [json.loads(event) for event in bad[:-1]]
    assert bad_events[-2]["choices"][0]["finish_reason"] == "error"
    assert bad_events[-1]["error"]["code"] == "request_failed" and bad_events[-1]["error"]["type"] == "server_error"
    good_events = [json.loads(event) for event in good[:-1]]
    assert good_events[-1]["choices"][0]["finish_reason"] == "length"
    assert not any("error" in event for event in good_events)


def test_fork_failure_ends_only_the_forked_sequence(text_checkpoint: Path, reference: dict[str, RequestOutput],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A runner fork that raises ends only the sequence being forked, with "error"; its parent
    and every other request in the batch finish normally with the tokens of a run without it."""
    engine = _engine(text_checkpoint)
    forks = {"raised": 0}

    def failing_fork(fork: object) -> None:
        forks["raised"] += 1
        raise RuntimeError("injected fork failure")

    monkeypatch.setattr(engine.executor, "fork", failing_fork)
    engine.add_request("forked", _prompt(30, seed=99), SamplingParams(n=2, max_tokens=12, temperature=0.0,
                                                                       ignore_eos=True))
    finished = _run(engine, PROMPTS)
    assert forks["raised"] == 1
    forked = finished.pop("forked")
    assert [c.finish_reason for c in forked.outputs] == ["length", "error"], forked
    assert len(forked.outputs[0].token_ids) == 12 and forked.outputs[1].token_ids == []
    assert finished.keys() == reference.keys()
    for request_id, ref in reference.items():
        assert finished[request_id].outputs[0].token_ids == ref.outputs[0].token_ids, request_id
        assert finished[request_id].outputs[0].finish_reason == "length"


def test_a_forward_that_always_fails_with_one_request_ends_only_that_request(
        text_checkpoint: Path, reference: dict[str, RequestOutput], monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward raises whenever one request's prompt is in it: its batch-mates become suspects that
    each run alone once and go on; only the request that fails alone is charged, and ends "error"."""
    marker = 299  # below every other prompt's token ids
    prompts = dict(PROMPTS, r3=PROMPTS["r3"][:20] + [marker] + PROMPTS["r3"][21:])
    assert all(marker not in prompt for name, prompt in prompts.items() if name != "r3")
    original = ModelRunner.execute_plan
    failures = {"n": 0}

    def failing(self: ModelRunner, plan: StepPlan, restored: bool = False) -> ForwardResult:
        if any(marker in chunk.token_ids for chunk in plan.chunks):
            failures["n"] += 1
            raise RuntimeError("injected forward failure")
        return original(self, plan, restored)

    monkeypatch.setattr(ModelRunner, "execute_plan", failing)
    engine = _engine(text_checkpoint)
    finished = _run(engine, prompts)
    assert failures["n"] >= engine_module.MAX_FAILED_STEPS
    _assert_only_victim_failed(finished, reference, "r3")
    assert finished["r3"].outputs[0].token_ids == [] and not engine.scheduler.suspects

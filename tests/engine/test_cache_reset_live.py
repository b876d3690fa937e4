"""`reset_prefix_cache` in the live engine (TP=1): the device forgets and a later prompt is served
from the host tier, or (with `reset_tiers`) computed whole, with the same output; a disk tier's
objects are deleted and a restart finds none; running requests refuse a reset or are preempted by
one and finish as they would have."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.cache.tiers import TierStats
from hybridserve.errors import EngineDeadError
from tests.helpers.targets import CPU

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _tokens(length: int, seed: int) -> list[int]:
    return torch.randint(0, 4000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _tier(llm: LLM, name: str) -> TierStats:
    return next(stats for stats in llm.tier_stats() if stats.name == name)


def _private_dir(path: Path) -> str:
    path.mkdir(mode=0o700)
    os.chmod(path, 0o700)
    return str(path)


def _run(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
    out = llm.generate([prompt], PARAMS, use_tqdm=False)[0]
    llm.llm_engine.check_integrity()
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_reset_forgets_the_device_then_every_tier() -> None:
    llm = LLM(**CPU.engine_kwargs(), kv_cache_mib=8, prefix_cache_mib=8, host_cache_memory="64MiB")  # type: ignore[arg-type]
    prompt = _tokens(300, seed=3)
    want, cached = _run(llm, prompt)
    assert cached == 0
    assert _run(llm, prompt) == (want, 288)  # the prompt mark, from the device

    assert llm.reset_prefix_cache()
    stats = llm.prefix_cache_stats()
    assert llm.llm_engine.cache.snapshots is not None and llm.llm_engine.cache.snapshots.num_published == 0
    tokens, cached = _run(llm, prompt)
    assert tokens == want and cached == 288 and _tier(llm, "host").hits == 1  # the host tier kept it
    assert llm.prefix_cache_stats().hits == stats.hits + 1

    assert llm.reset_prefix_cache(reset_tiers=True)
    assert _tier(llm, "host").entries == 0
    assert _run(llm, prompt) == (want, 0)
    llm.llm_engine.shutdown()


def test_reset_deletes_the_disk_objects_and_a_restart_finds_none(tmp_path: Path) -> None:
    directory = _private_dir(tmp_path / "tiers")
    flags = {"kv_cache_mib": 8, "prefix_cache_mib": 8, "disk_cache_dir": directory, "disk_cache_size": "64MiB"}
    prompt = _tokens(300, seed=4)
    first = LLM(**CPU.engine_kwargs(), **flags)  # type: ignore[arg-type]
    want, _ = _run(first, prompt)
    deadline = time.monotonic() + 30
    while not list(Path(directory).glob("*/*.obj")) and time.monotonic() < deadline:
        time.sleep(0.05)  # the disk tier's writes run in the background
    assert list(Path(directory).glob("*/*.obj")), "the disk tier wrote nothing to reset"
    assert first.reset_prefix_cache(reset_tiers=True)
    assert _tier(first, "disk").entries == 0
    first.llm_engine.shutdown()  # drains the queued deletes
    assert not list(Path(directory).glob("*/*.obj"))  # deleted, not only forgotten
    restarted = LLM(**CPU.engine_kwargs(), **flags)  # type: ignore[arg-type]
    assert _run(restarted, prompt) == (want, 0)
    restarted.llm_engine.shutdown()


def test_running_requests_refuse_a_reset_or_are_preempted_by_it() -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [_tokens(200, seed=5), _tokens(150, seed=6)]
    reference = LLM(**CPU.engine_kwargs(), kv_cache_mib=8, prefix_cache_mib=0)  # type: ignore[arg-type]
    want = [out.outputs[0].token_ids for out in reference.generate(prompts, params, use_tqdm=False)]
    reference.llm_engine.shutdown()

    llm = LLM(**CPU.engine_kwargs(), kv_cache_mib=8, prefix_cache_mib=8)  # type: ignore[arg-type]
    engine = llm.llm_engine
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params)
    got: dict[str, list[int]] = {}
    for step in range(200):
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        if step == 3:
            assert engine.num_running_requests > 0
            published = engine.cache.snapshots.num_published  # type: ignore[union-attr]
            assert not engine.reset_prefix_cache()
            assert engine.cache.snapshots.num_published == published  # type: ignore[union-attr]
        if step == 6:
            assert engine.num_running_requests > 0
            assert engine.reset_prefix_cache(reset_running_requests=True)
            assert engine.num_running_requests == 0 and engine.scheduler.num_preemptions > 0
        engine.check_integrity()
        if not engine.has_unfinished_requests():
            break
    assert got == {"r0": want[0], "r1": want[1]}
    engine.shutdown()


@pytest.mark.parametrize("argument", [{"reset_running_requests": "yes"}, {"reset_tiers": 1}])
def test_reset_arguments_must_be_booleans(argument: dict[str, object]) -> None:
    llm = LLM(**CPU.engine_kwargs(), kv_cache_mib=2, prefix_cache_mib=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="true or false"):
        llm.reset_prefix_cache(**argument)  # type: ignore[arg-type]
    llm.llm_engine.shutdown()


def test_a_stopped_engine_refuses_a_reset() -> None:
    """Its tier stores are closed: nothing may be queued to them."""
    llm = LLM(**CPU.engine_kwargs(), kv_cache_mib=2, prefix_cache_mib=2, host_cache_memory="16MiB")  # type: ignore[arg-type]
    llm.llm_engine.shutdown()
    with pytest.raises(EngineDeadError):
        llm.reset_prefix_cache()

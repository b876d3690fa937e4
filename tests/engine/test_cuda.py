"""The differential, lower-tier and server tests on CUDA in bfloat16 (marked `cuda`; skipped without a GPU).
The parity tests' CUDA variant is in tests/models/test_parity.py. Tolerances: tests/helpers/targets.py (CUDA)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridserve.engine.async_engine import AsyncLLMEngine
from hybridserve.engine.engine import LLMEngine
from hybridserve.server.app import build_app
from tests.helpers.live_server import ServerThread, engine_stats, is_idle, wait_until
from tests.helpers.prefix_cache import multi_turn_workload
from tests.helpers.targets import CUDA, requires_cuda

pytestmark = [pytest.mark.cuda, requires_cuda, pytest.mark.timeout(300)]


def _assert_warm_logits_match_cold(on: LLM, off: LLM, seed: int) -> None:
    """Over the multi-turn workload of `seed`, the logits of the positions `on` computes equal
    `off`'s (cache off) within the bf16 tolerance; `on`'s pools consistent after every round."""
    for batch in multi_turn_workload(seed):
        for prompt in batch:
            warm = on.llm_engine.prompt_logits(prompt).float().cpu()
            cold = off.llm_engine.prompt_logits(prompt).float().cpu()
            assert (warm - cold[-warm.shape[0]:]).abs().max().item() <= CUDA.logit_atol
        on.llm_engine.check_integrity()


@pytest.mark.parametrize("seed", [0, 1])
def test_differential_cache_on_off_cuda_bf16(text_checkpoint: Path, seed: int) -> None:
    """Logits of the positions a warm request computes equal those of a cold run within the bf16
    tolerance, over a multi-turn workload that hits, misses and evicts."""
    on = LLM(model=str(text_checkpoint), **CUDA.engine_kwargs(), kv_cache_mib=4, prefix_cache_mib=4,
             snapshot_interval=32, max_num_batched_tokens=160, max_num_seqs=4)
    off = LLM(model=str(text_checkpoint), **CUDA.engine_kwargs(), kv_cache_mib=4, prefix_cache_mib=0)
    _assert_warm_logits_match_cold(on, off, seed)
    assert on.prefix_cache_stats().hits > 0
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert len(on.generate([multi_turn_workload(seed)[-1][0]], params)[0].outputs[0].token_ids) == 8
    on.llm_engine.check_integrity()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_lower_tier_restores_cuda_bf16(text_checkpoint: Path, tier: str, tmp_path: Path) -> None:
    """Device pools too small for the workload push snapshots and KV down to host memory or disk;
    the restored prompts' logits equal a cold run's within the bf16 tolerance, and the tier served
    hits, KV blocks among them, without a failed move."""
    if tier == "host":
        flags: dict[str, str] = {"host_cache_memory": "64MiB"}
    else:
        (tmp_path / "tiers").mkdir(mode=0o700)
        os.chmod(tmp_path / "tiers", 0o700)
        flags = {"disk_cache_dir": str(tmp_path / "tiers"), "disk_cache_size": "64MiB"}
    on = LLM(model=str(text_checkpoint), **CUDA.engine_kwargs(), kv_cache_mib=0.1, prefix_cache_mib=0.05,
             snapshot_interval=32, max_num_batched_tokens=160, max_num_seqs=4, **flags)
    off = LLM(model=str(text_checkpoint), **CUDA.engine_kwargs(), kv_cache_mib=4, prefix_cache_mib=0)
    for seed in (0, 1):
        _assert_warm_logits_match_cold(on, off, seed)
    stats = next(stats for stats in on.tier_stats() if stats.name == tier)
    assert stats.demotions > 0 and stats.hits > 0 and stats.promoted_objects > stats.promotions
    assert stats.failed == 0
    on.llm_engine.shutdown()


@pytest.fixture(scope="module")
def cuda_server() -> Iterator[tuple[ServerThread, AsyncLLMEngine]]:
    config = EngineConfig(**CUDA.engine_kwargs(), cache=CacheConfig(kv_cache_mib=64, prefix_cache_mib=64),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024))
    engine = AsyncLLMEngine(LLMEngine(config), max_waiting_requests=32)
    with ServerThread(build_app(engine, model_name="tiny")) as server:
        yield server, engine
    engine.shutdown()


def test_server_cuda_bf16(cuda_server: tuple[ServerThread, AsyncLLMEngine]) -> None:
    server, engine = cuda_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    prefix = "You are a helpful assistant for the hybridserve engine. " * 30
    first = client.completions.create(model="tiny", prompt=prefix + "One", max_tokens=6, temperature=0)
    second = client.completions.create(model="tiny", prompt=prefix + "Two", max_tokens=6, temperature=0)
    assert first.choices[0].finish_reason in ("length", "stop")
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=5, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    wait_until(lambda: is_idle(engine))
    assert engine_stats(engine)["kv_blocks_used"] == 0

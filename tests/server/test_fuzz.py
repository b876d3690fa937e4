"""Property-based HTTP fuzzing of the server from its own OpenAPI schema (schemathesis), the dev-mode
routes included: no 5xx, no hang, every error in OpenAI's envelope. A bounded number of examples
keeps it in the default suite; FUZZ_EXAMPLES raises it. CPU, float32, a 64-token context so every
request is short."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from hybridserve.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridserve.engine.async_engine import AsyncLLMEngine
from hybridserve.engine.engine import LLMEngine
from hybridserve.server.app import build_app
from tests.helpers.live_server import ServerThread

MAX_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "25"))
CALL_TIMEOUT_S = 60.0  # a response slower than this is a hang
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def fuzz_engine() -> Iterator[AsyncLLMEngine]:
    config = EngineConfig(device="cpu", dtype="float32",
                          cache=CacheConfig(kv_cache_mib=8, prefix_cache_mib=8, snapshot_interval=16),
                          scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=64))
    engine = AsyncLLMEngine(LLMEngine(config), max_waiting_requests=64)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def fuzz_server(fuzz_engine: AsyncLLMEngine) -> Iterator[ServerThread]:
    with ServerThread(build_app(fuzz_engine, model_name="tiny", max_body_bytes=64 * 1024, dev_mode=True)) as server:
        yield server


@pytest.fixture(scope="module")
def api_schema(fuzz_server: ServerThread) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")


def _check_envelope(body: object) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and "param" in error and "code" in error


def _check_event_stream(text: str) -> None:
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-500:]
    for event in events[:-1]:
        payload = json.loads(event)
        if "error" in payload:
            _check_envelope(payload)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzz_server_from_its_openapi_schema(api_schema: schemathesis.BaseSchema, fuzz_server: ServerThread,
                                             mode: GenerationMode) -> None:
    """Requests generated from /openapi.json, valid (positive) and invalid (negative) ones."""
    seen: list[int] = []

    @given(case=api_schema.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def check(case: schemathesis.Case) -> None:
        response = case.call(base_url=fuzz_server.url, timeout=CALL_TIMEOUT_S)
        seen.append(response.status_code)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
        content_type = response.headers.get("content-type", "")
        if response.status_code >= 400:
            _check_envelope(response.json())
        elif "text/event-stream" in content_type:
            _check_event_stream(response.text)
        elif "application/json" in content_type:
            response.json()

    check()
    assert len(seen) >= MAX_EXAMPLES // 2
    if mode is GenerationMode.NEGATIVE:
        assert any(400 <= status < 500 for status in seen)


def test_schema_is_published(fuzz_server: ServerThread, api_schema: schemathesis.BaseSchema) -> None:
    import httpx

    spec = httpx.get(f"{fuzz_server.url}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(spec["paths"])
    assert "CompletionRequest" in spec["components"]["schemas"]
    docs = httpx.get(f"{fuzz_server.url}/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_engine_is_clean_after_fuzzing(fuzz_engine: AsyncLLMEngine) -> None:
    """Runs after the fuzz cases (same module): every pool back to idle, no open reservation."""
    import asyncio
    import time

    deadline = time.monotonic() + 30
    while True:
        try:
            asyncio.run(fuzz_engine.check_integrity())
            stats = asyncio.run(fuzz_engine.stats())
            if stats["num_running"] == 0 and stats["num_waiting"] == 0:
                break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        assert time.monotonic() < deadline, "engine did not become idle"
        time.sleep(0.1)
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_free"] == stats["state_slots_total"]

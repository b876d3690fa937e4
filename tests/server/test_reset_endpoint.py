"""`POST /reset_prefix_cache` (dev mode only, as in vLLM): 404 without HYBRIDSERVE_SERVER_DEV_MODE;
with it, the next request of a cached prompt computes it whole; 409 while requests run unless they
are preempted (they then finish with the same tokens); bad values and missing keys get 4xx."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from hybridserve.engine.async_engine import AsyncLLMEngine
from hybridserve.engine.engine import LLMEngine
from hybridserve.server.app import build_app
from tests.helpers.live_server import ServerThread, tiny_config

MODEL = "tiny"
API_KEY = "reset-key"
PROMPT = "The joint prefix cache keeps the KV and the recurrent state at one boundary. " * 8

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncLLMEngine]:
    async_engine = AsyncLLMEngine(LLMEngine(tiny_config()), max_waiting_requests=64)
    yield async_engine
    async_engine.shutdown()


@pytest.fixture()
def dev_server(engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch) -> Iterator[httpx.Client]:
    monkeypatch.setenv("HYBRIDSERVE_SERVER_DEV_MODE", "1")
    with ServerThread(build_app(engine, model_name=MODEL, api_key=API_KEY)) as srv, \
            httpx.Client(base_url=srv.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        yield http


def _complete(http: httpx.Client, max_tokens: int = 4) -> dict:
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens,
                                                   "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()


def test_without_dev_mode_the_endpoint_is_not_served(engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYBRIDSERVE_SERVER_DEV_MODE", raising=False)
    with ServerThread(build_app(engine, model_name=MODEL)) as srv:
        assert httpx.post(f"{srv.url}/reset_prefix_cache", timeout=30).status_code == 404


def test_reset_makes_the_next_request_compute_its_prompt(dev_server: httpx.Client, engine: AsyncLLMEngine) -> None:
    first = _complete(dev_server)
    again = _complete(dev_server)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    response = dev_server.post("/reset_prefix_cache")
    assert response.status_code == 200 and response.json() == {"reset": True}
    after = _complete(dev_server)
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert after["choices"][0]["text"] == first["choices"][0]["text"]


def test_running_requests_get_409_or_are_preempted(dev_server: httpx.Client) -> None:
    want = _complete(dev_server, max_tokens=600)["choices"][0]["text"]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 600, "temperature": 0, "ignore_eos": True, "stream": True}
    text, answers = [], []
    with dev_server.stream("POST", "/v1/completions", json=body) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: {"):
                continue
            text.append(httpx.Response(200, content=line[6:]).json()["choices"][0]["text"])
            if len(text) == 2:  # the request runs now
                answers.append(dev_server.post("/reset_prefix_cache"))
                answers.append(dev_server.post("/reset_prefix_cache", params={"reset_running_requests": "true"}))
    refused, preempted = answers
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "requests_running"
    assert preempted.status_code == 200
    assert "".join(text) == want


def test_bad_values_and_missing_keys_are_refused(dev_server: httpx.Client) -> None:
    response = dev_server.post("/reset_prefix_cache", params={"reset_tiers": "maybe"})
    assert response.status_code == 400 and "error" in response.json()
    assert dev_server.post("/reset_prefix_cache", headers={"Authorization": "Bearer wrong"}).status_code == 401

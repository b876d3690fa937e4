"""Hostile and careless clients against a live keyed server with a small waiting queue: every
route but the probes needs a key (also under a root path), every over-limit, malformed or
wrongly typed request gets a clear 4xx (never a 5xx) many times past the queue limit and from two
tenants at once, one tenant cannot hold the whole queue, request ids come back and are logged,
and /docs needs no CDN."""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from hybridserve.engine.async_engine import AsyncLLMEngine
from hybridserve.engine.engine import LLMEngine
from hybridserve.server.app import build_app
from hybridserve.server.auth import PUBLIC_PATHS
from hybridserve.server.docs_ui import install_docs_routes
from hybridserve.server.limits import DEFAULT_LIMITS as LIMITS
from tests.helpers.live_server import VOCAB, ServerThread, is_idle, tiny_config, wait_until

MODEL = "tiny"
KEYS = ("hostile-key-a", "hostile-key-b")
MAX_WAITING = 4
ROOT = "/api"
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
pytestmark = pytest.mark.timeout(120)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncLLMEngine]:
    async_engine = AsyncLLMEngine(LLMEngine(tiny_config()), max_waiting_requests=MAX_WAITING)
    yield async_engine
    async_engine.shutdown()


@pytest.fixture(scope="module")
def app(engine: AsyncLLMEngine) -> Any:
    return build_app(engine, model_name=MODEL, api_keys=list(KEYS), max_body_bytes=256 * 1024)


@pytest.fixture(scope="module")
def server(app: Any, engine: AsyncLLMEngine) -> Iterator[ServerThread]:
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def rooted(app: Any) -> Iterator[ServerThread]:
    """The same app behind uvicorn's `--root-path /api`."""
    with ServerThread(app, root_path=ROOT) as srv:
        yield srv


# --------------------------------------------------------------------------- auth on every route
def _route_calls(app: Any) -> list[tuple[str, str]]:
    """(method, path) of every route of the app, path parameters filled in."""
    calls = []
    for route in app.routes:
        path = re.sub(r"\{[^}]+\}", "swagger-ui.css", getattr(route, "path", ""))
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                calls.append((method, path))
    return calls


def test_every_route_but_the_probes_needs_a_key(app: Any, server: ServerThread, rooted: ServerThread) -> None:
    calls = _route_calls(app)
    paths = {path for _, path in calls}
    assert {"/tokenize", "/detokenize", "/metrics", "/docs", "/openapi.json", CMPL, CHAT, "/ready"} <= paths
    for base, prefixes in ((server.url, ("",)), (rooted.url, ("", ROOT))):
        for prefix in prefixes:
            for method, path in [*calls, ("GET", "/no/such/route"), ("POST", "/v1/no-such-route")]:
                response = httpx.request(method, f"{base}{prefix}{path}", json={}, headers=auth("wrong"))
                if path in PUBLIC_PATHS and prefix == "":
                    assert response.status_code == 200, (base, path, response.text)
                else:
                    assert response.status_code == 401, (base, prefix, method, path, response.status_code)
                    assert response.json()["error"]["code"] == "invalid_api_key"
    for base in (server.url, rooted.url):
        assert httpx.get(f"{base}/v1/models", headers=auth(KEYS[1])).status_code == 200
        assert httpx.get(f"{base}/metrics", headers=auth(KEYS[0])).status_code == 200


def test_ready_answers_503_until_the_engine_runs() -> None:
    engine = AsyncLLMEngine(LLMEngine(tiny_config()), max_waiting_requests=MAX_WAITING)
    client = TestClient(build_app(engine, model_name=MODEL, api_keys=list(KEYS)))  # no lifespan: not started
    try:
        assert client.get("/ready").status_code == 503
        engine.start()
        assert client.get("/ready").status_code == 200 and client.get("/health").status_code == 200
        engine.shutdown()
        assert client.get("/ready").status_code == 503
    finally:
        engine.shutdown()


# --------------------------------------------------------------------------- hostile inputs
def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _deep_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


USER = [{"role": "user", "content": "hi"}]
OVER = {  # name: (route, body as JSON text or a value to encode, expected status)
    "token-id-2**64": (CMPL, {"prompt": [2**64], "max_tokens": 1}, 400),
    "token-id-vocab": (CMPL, {"prompt": [5, VOCAB], "max_tokens": 1}, 400),
    "token-id-batch": (CMPL, {"prompt": [[5], [2**70]], "max_tokens": 1}, 400),
    "too-many-prompts": (CMPL, {"prompt": ["a"] * (LIMITS.prompt_cap(MAX_WAITING) + 1), "max_tokens": 1}, 400),
    "too-many-prompts-big": (CMPL, {"prompt": [[7]] * 5000, "max_tokens": 1}, 400),
    "too-many-stops": (CMPL, {"prompt": "a", "stop": [f"s{i}" for i in range(LIMITS.max_stop_strings + 1)]}, 400),
    "long-stop": (CMPL, {"prompt": "a", "stop": "x" * (LIMITS.max_stop_string_chars + 1)}, 400),
    "too-many-stop-ids": (CMPL, {"prompt": "a", "stop_token_ids": list(range(LIMITS.max_stop_token_ids + 1))}, 400),
    "stop-id-2**64": (CMPL, {"prompt": "a", "stop_token_ids": [2**64]}, 400),
    "stop-id-negative": (CHAT, {"messages": USER, "stop_token_ids": [-1]}, 400),
    "n-too-large": (CMPL, {"prompt": "a", "n": 1000}, 400),
    "best-of": (CMPL, {"prompt": "a", "best_of": 50}, 400),
    "logit-bias-size": (CMPL, {"prompt": "a", "logit_bias": {str(i): 1.0 for i in range(LIMITS.max_logit_bias + 1)}},
                        400),
    "logit-bias-id": (CMPL, {"prompt": "a", "logit_bias": {str(2**64): 1.0}}, 400),
    "too-many-tools": (CHAT, {"messages": USER, "tools": [_tool(f"f{i}", {"type": "object"})
                                                          for i in range(LIMITS.max_tools + 1)]}, 400),
    "tool-schema-size": (CHAT, {"messages": USER, "tools": [_tool("f", {
        "type": "object", "description": "d" * LIMITS.max_schema_bytes})]}, 400),
    "tool-schema-depth": (CHAT, {"messages": USER, "tools": [_tool("f", _deep_schema(LIMITS.max_schema_depth))],
                                 "tool_choice": "required"}, 400),
    "tool-max-length": (CHAT, {"messages": USER, "tool_choice": "required", "tools": [_tool("f", {
        "type": "object", "properties": {"s": {"type": "string", "maxLength": 10**9}}})]}, 400),
    "response-format-size": (CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}}}},
        400),
    "guided-regex-size": (CMPL, {"prompt": "a", "guided_regex": "a" * (LIMITS.max_schema_bytes + 1)}, 400),
    "body-size": (CMPL, {"prompt": "a" * (300 * 1024)}, 413),
    "nested-unknown-field": (CMPL, '{"prompt": "a", "junk": ' + _nested(100_000) + "}", 400),
    "nested-known-field": (CHAT, '{"messages": ' + _nested(50_000) + "}", 400),
    "nested-kwargs": (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"a": '
                      + _nested(3000) + "}}", 400),
    "prompt-object": (CMPL, {"prompt": {"a": 1}}, 400),
    "max-tokens-string": (CMPL, {"prompt": "a", "max_tokens": "5"}, 400),
    "max-tokens-huge": (CMPL, {"prompt": "a", "max_tokens": 2**80}, 400),
    "temperature-list": (CMPL, {"prompt": "a", "temperature": []}, 400),
    "n-float": (CMPL, {"prompt": "a", "n": 1.5}, 400),
    "stop-int": (CMPL, {"prompt": "a", "stop": 5}, 400),
    "messages-string": (CHAT, {"messages": "hi"}, 400),
    "content-number": (CHAT, {"messages": [{"role": "user", "content": 7}]}, 400),
    "seed-huge": (CMPL, {"prompt": "a", "seed": 2**70}, 400),
    "body-array": (CMPL, [1, 2, 3], 400),
    "body-not-json": (CMPL, "{not json", 400),
    "body-nan": (CMPL, '{"prompt": "a", "temperature": NaN}', 400),
    "unknown-model": (CMPL, {"model": "x" * 10_000, "prompt": "a"}, 404),
    "detokenize-2**64": ("/detokenize", {"tokens": [2**64]}, 400),
    "tokenize-tools": ("/tokenize", {"messages": USER, "tools": [_tool(f"f{i}", {"type": "object"})
                                                                for i in range(LIMITS.max_tools + 1)]}, 400),
}


def _post(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return client.post(path, content=content, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("name", sorted(OVER))
def test_each_hostile_input_gets_a_clear_4xx(server: ServerThread, name: str) -> None:
    path, body, status = OVER[name]
    with httpx.Client(base_url=server.url, headers=auth(KEYS[0]), timeout=60) as client:
        response = _post(client, path, body)
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert error["message"] and error["type"] and len(response.content) < 4096


def test_hostile_inputs_past_the_queue_limit_from_two_tenants(server: ServerThread, engine: AsyncLLMEngine) -> None:
    """Every hostile input, several times each from two tenants at once (far more requests than
    the waiting queue holds): only 4xx answers, nothing left behind, then both tenants are served."""
    cases = [case for case in OVER.values() if case[2] != 413] * 3
    statuses: dict[str, list[int]] = {key: [] for key in KEYS}

    def flood(key: str) -> None:
        with httpx.Client(base_url=server.url, headers=auth(key), timeout=60) as client:
            statuses[key] += [_post(client, path, body).status_code for path, body, _ in cases]

    threads = [threading.Thread(target=flood, args=(key,)) for key in KEYS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    for key in KEYS:
        assert len(statuses[key]) == len(cases) > 5 * MAX_WAITING
        assert all(400 <= status < 500 for status in statuses[key]), sorted(set(statuses[key]))
    wait_until(lambda: is_idle(engine))
    for key in KEYS:
        good = httpx.post(f"{server.url}{CMPL}", json={"prompt": [5, 6, 7], "max_tokens": 2}, headers=auth(key),
                          timeout=60)
        assert good.status_code == 200, good.text
        chat = httpx.post(f"{server.url}{CHAT}", json={"messages": USER, "max_tokens": 2}, headers=auth(key),
                          timeout=60)
        assert chat.status_code == 200, chat.text


def test_one_tenant_cannot_hold_the_waiting_queue(server: ServerThread, engine: AsyncLLMEngine) -> None:
    cap = LIMITS.tenant_cap(MAX_WAITING)
    assert cap is not None and cap < MAX_WAITING
    slow = {"prompt": "hold", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, headers=auth(KEYS[0]), timeout=60) as a, \
            httpx.Client(base_url=server.url, headers=auth(KEYS[1]), timeout=60) as b:
        held = []
        for _ in range(cap):
            stream = a.stream("POST", CMPL, json=slow)
            response = stream.__enter__()
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            held.append((stream, lines))
        refused = a.post(CMPL, json={"prompt": "one more", "max_tokens": 1})
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "tenant_limit"
        assert int(refused.headers["retry-after"]) >= 1
        batch = a.post(CMPL, json={"prompt": ["x", "y"], "max_tokens": 1})
        assert batch.status_code == 429
        assert b.post(CMPL, json={"prompt": "other tenant", "max_tokens": 1}).status_code == 200
        for stream, _ in held:
            stream.__exit__(None, None, None)
        wait_until(lambda: is_idle(engine))
        assert a.post(CMPL, json={"prompt": "after", "max_tokens": 1}).status_code == 200


# --------------------------------------------------------------------------- request ids and logs
def test_request_ids_come_back_and_are_logged(server: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hybridserve.access")
    mine = httpx.get(f"{server.url}/v1/models", headers={**auth(KEYS[0]), "x-request-id": "trace-42.a:b"})
    assert mine.headers["x-request-id"] == "trace-42.a:b"
    for bad in ("x" * 65, "has space", "semi;colon"):
        replaced = httpx.get(f"{server.url}/v1/models", headers={**auth(KEYS[0]), "x-request-id": bad})
        assert re.fullmatch(r"[0-9a-f]{32}", replaced.headers["x-request-id"])
    refused = httpx.get(f"{server.url}/metrics")
    assert refused.status_code == 401 and re.fullmatch(r"[0-9a-f]{32}", refused.headers["x-request-id"])
    wait_until(lambda: any(refused.headers["x-request-id"] in r.getMessage() for r in caplog.records), 5)
    lines = [r.getMessage() for r in caplog.records if r.name == "hybridserve.access"]
    assert any("trace-42.a:b" in line and '"GET /v1/models"' in line and " 200 " in line for line in lines)
    assert any(refused.headers["x-request-id"] in line and " 401 " in line for line in lines)


def test_logged_request_values_are_escaped_and_cut(server: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    evil = "evil\nFAKE 200 OK\x1b[31m" + "z" * 5000
    body = {"prompt": [5], "max_tokens": 1, evil: 1, **{f"junk{i}": i for i in range(50)}}
    assert httpx.post(f"{server.url}{CMPL}", json=body, headers=auth(KEYS[1]), timeout=60).status_code == 200
    path = "/v1/%0aFAKE%1b" + "p" * 3000
    httpx.get(f"{server.url}{path}", headers=auth(KEYS[1]))
    wait_until(lambda: any("ignored unknown field" in r.getMessage() for r in caplog.records), 5)
    wait_until(lambda: any("FAKE" in r.getMessage() and r.name == "hybridserve.access" for r in caplog.records), 5)
    for record in (r for r in caplog.records if r.name.startswith("hybridserve")):  # the server's, not httpx's
        message = record.getMessage()
        assert "\n" not in message and "\x1b" not in message and len(message) < 2000, message[:200]
    warning = next(r.getMessage() for r in caplog.records if "ignored unknown field" in r.getMessage())
    assert "evil\\nFAKE" in warning and "more)" in warning


# --------------------------------------------------------------------------- docs
def test_docs_page_loads_nothing_from_outside(server: ServerThread, rooted: ServerThread) -> None:
    for base, prefix in ((server.url, ""), (rooted.url, ROOT)):
        page = httpx.get(f"{base}/docs", headers=auth(KEYS[0]))
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "http://" not in page.text and "https://" not in page.text
        assert f"{prefix}/openapi.json" in page.text
        for asset in re.findall(r'(?:src|href)="([^"]+)"', page.text):
            assert asset.startswith(f"{prefix}/docs/assets/"), asset
            fetched = httpx.get(f"{base}{asset.removeprefix(prefix)}", headers=auth(KEYS[0]))
            assert fetched.status_code == 200 and len(fetched.content) > 0
    assert httpx.get(f"{server.url}/docs/assets/index.html", headers=auth(KEYS[0])).status_code == 404
    assert httpx.get(f"{server.url}/openapi.json", headers=auth(KEYS[0])).json()["paths"]


def test_docs_without_the_asset_package_is_a_page_linking_the_schema() -> None:
    app = FastAPI(title="plain", docs_url=None, redoc_url=None)
    install_docs_routes(app, None)
    page = TestClient(app, root_path=ROOT).get("/docs")
    assert page.status_code == 200 and f"href='{ROOT}/openapi.json'" in page.text
    assert "http://" not in page.text and "https://" not in page.text

"""End-to-end tests of the OpenAI-compatible server: a real uvicorn server on a free loopback
port in a background thread, the built-in tiny model, the official `openai` client plus raw
httpx for error cases, disconnects and limits."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hybridserve.engine.async_engine import AsyncLLMEngine
from hybridserve.engine.engine import LLMEngine
from hybridserve.engine.memory import allocator_free_bytes
from hybridserve.engine_args import engine_config_from_args
from hybridserve.sampling_params import CompletionOutput, RequestOutput, RequestOutputKind, SamplingParams
from hybridserve.server.app import build_app
from hybridserve.server.cli import build_parser, check_http_arguments, served_model_names
from hybridserve.server.metrics import ServerMetrics
from hybridserve.server.protocol import ChatCompletionStreamResponse, CompletionStreamResponse
from tests.helpers.live_server import ServerThread, engine_stats, is_idle, random_ids, tiny_config, wait_until

MODEL = "tiny"
API_KEY = "sekrit-key"
MAX_MODEL_LEN = 32768  # the built-in model's max_position_embeddings

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncLLMEngine]:
    async_engine = AsyncLLMEngine(LLMEngine(tiny_config()), max_waiting_requests=64)
    yield async_engine
    async_engine.shutdown()


@pytest.fixture(scope="module")
def server(engine: AsyncLLMEngine) -> Iterator[ServerThread]:
    with ServerThread(build_app(engine, model_name=MODEL, api_key=None)) as srv:
        yield srv


@pytest.fixture(scope="module")
def restricted(engine: AsyncLLMEngine) -> Iterator[ServerThread]:
    """Same engine, with an API key and a 4 KiB body limit."""
    with ServerThread(build_app(engine, model_name=MODEL, api_key=API_KEY, max_body_bytes=4096)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


# --------------------------------------------------------------------------- basic API
def test_completion(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="The joint prefix cache", max_tokens=4, temperature=0)
    assert out.object == "text_completion" and len(out.choices) == 1
    assert isinstance(out.choices[0].text, str) and out.choices[0].finish_reason in ("stop", "length")
    usage = out.usage
    assert usage.prompt_tokens > 0 and 1 <= usage.completion_tokens <= 4
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0


def test_chat_completion(client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and isinstance(out.choices[0].message.content, str)
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    expected_prompt = engine.tokenizer.encode(rendered + "<|im_start|>assistant\n<think>\n")
    assert out.usage.prompt_tokens == len(expected_prompt)
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_models_and_health(http: httpx.Client) -> None:
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert http.get("/health").status_code == 200


def test_server_connections_send_without_nagle_delay(server: ServerThread, http: httpx.Client) -> None:
    """Every accepted connection has TCP_NODELAY: with Nagle on, each response after the first on
    a keep-alive connection waited ~40 ms for the client's delayed ACK (a socket made with proto 0
    is not recognised as TCP by asyncio, which then leaves Nagle on)."""
    assert http.get("/health").status_code == 200  # opens (or reuses) the keep-alive connection
    sockets = [p.transport.get_extra_info("socket") for p in list(server.server.server_state.connections)]
    sockets = [sock for sock in sockets if sock is not None]  # a connection closing right now has none
    assert sockets
    assert all(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0 for sock in sockets)


def test_streaming_equals_greedy(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "prompt": "Streaming text", "max_tokens": 6, "temperature": 0}
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason

    messages = [{"role": "user", "content": "Stream me"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    parts = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                                stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == chat.choices[0].message.content


def test_sse_wire_format(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "wire", "max_tokens": 2, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["usage"] is None


def test_streamed_chunks_are_the_models_json(http: httpx.Client) -> None:
    """Text-only chunks come from a template (server/sse.py); every chunk on the wire must still be
    exactly the JSON its pydantic model dumps, with one `created` for the whole response."""
    cases = [("/v1/completions", CompletionStreamResponse, {"prompt": "templates", "n": 2}),
             ("/v1/chat/completions", ChatCompletionStreamResponse,
              {"messages": [{"role": "user", "content": "templates"}]})]
    for path, model, extra in cases:
        body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, **extra}
        with http.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            payloads = [line[6:] for line in response.iter_lines() if line and line != "data: [DONE]"]
        assert len(payloads) >= 8
        for payload in payloads:
            assert model.model_validate_json(payload).model_dump_json() == payload
        assert len({json.loads(payload)["created"] for payload in payloads}) == 1


def test_n_seed_and_logprobs(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "prompt": "Sample", "max_tokens": 3, "temperature": 1.0, "n": 2, "seed": 7,
              "logprobs": 2}
    first, second = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in first.choices)
    assert all(len(top) <= 2 for c in first.choices for top in c.logprobs.top_logprobs)

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=2, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)


# --------------------------------------------------------------------------- prefix cache
def test_shared_prefix_reports_cached_tokens(client: openai.OpenAI) -> None:
    ids = random_ids(1, 700)
    other = ids[:600] + random_ids(2, 100)
    cold = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0)
    assert cold.usage.prompt_tokens == 700 and cold.usage.prompt_tokens_details.cached_tokens == 0
    warm = client.completions.create(model=MODEL, prompt=other, max_tokens=1, temperature=0)
    assert warm.usage.prompt_tokens_details.cached_tokens == 512  # joint boundary: 2 * snapshot_interval


def test_cache_salt_isolation(client: openai.OpenAI) -> None:
    ids = random_ids(3, 300)

    def cached(salt: str) -> int:
        out = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                        extra_body={"cache_salt": salt})
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached("alice") == 0
    assert cached("bob") == 0
    assert cached("alice") == 288  # the repeat restores its last block boundary (prompt mark)


# --------------------------------------------------------------------------- metrics
def scrape(http: httpx.Client) -> dict[str, float]:
    """`/metrics` as {sample name with labels: value}."""
    response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def test_metrics_move(http: httpx.Client, client: openai.OpenAI) -> None:
    before = scrape(http)
    for name in ("hybridserve_kv_blocks_used", "hybridserve_kv_blocks_cached", "hybridserve_kv_blocks_free",
                 "hybridserve_snapshots", "hybridserve_snapshot_bytes", "hybridserve_snapshot_evictions_total",
                 "hybridserve_num_requests_running", "hybridserve_num_requests_waiting",
                 "hybridserve_prefix_cache_hit_tokens_total"):
        assert name in before, name
    client.completions.create(model=MODEL, prompt="count me", max_tokens=2, temperature=0)
    after = scrape(http)
    for name in ("hybridserve_prefix_cache_queries_total", "hybridserve_prompt_tokens_total",
                 "hybridserve_generation_tokens_total", "hybridserve_time_to_first_token_seconds_count",
                 "hybridserve_e2e_request_latency_seconds_count"):
        assert after[name] > before.get(name, 0.0), name
    done = sum(v for k, v in after.items() if k.startswith("hybridserve_request_success_total"))
    assert done > sum(v for k, v in before.items() if k.startswith("hybridserve_request_success_total"))
    # pool capacities in bytes: 32 MiB of KV, 64 MiB of snapshots (tiny_config), weights held once
    assert after["hybridserve_kv_pool_bytes"] == 32 * 2**20
    assert 64 * 2**20 - after["hybridserve_bytes_per_snapshot"] < after["hybridserve_snapshot_pool_bytes"] <= 64 * 2**20
    assert after["hybridserve_weight_bytes"] == 116724608
    assert after["hybridserve_snapshots_reserved"] == after["hybridserve_snapshots_pinned"] == 0
    if allocator_free_bytes() > 0:  # glibc with mallinfo2 (2.33+): the engine's heap keeps freed activations
        assert after["hybridserve_heap_free_bytes"] > 0


def test_non_streamed_requests_get_their_final_output_only(http: httpx.Client, engine: AsyncLLMEngine) -> None:
    """A final-only request's stream yields one output, the same as the cumulative run's last; a
    non-streamed response is built that way, and its TTFT is dated by the engine's first token."""
    prompt = random_ids(7, 12)

    async def outputs(kind: RequestOutputKind) -> list:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, output_kind=kind)
        return [out async for out in engine.generate(f"kind-{int(kind)}", prompt, params)]

    cumulative = asyncio.run(outputs(RequestOutputKind.CUMULATIVE))
    final = asyncio.run(outputs(RequestOutputKind.FINAL_ONLY))
    assert len(cumulative) > 1 and len(final) == 1 and final[0].finished
    assert final[0].outputs[0].token_ids == cumulative[-1].outputs[0].token_ids
    before = scrape(http)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    assert http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 40
    after = scrape(http)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)
    assert delta("hybridserve_inter_token_latency_seconds_count") == 39
    ttft = delta("hybridserve_time_to_first_token_seconds_sum")
    e2e = delta("hybridserve_e2e_request_latency_seconds_sum")
    assert 0 < ttft < e2e  # the first token came before the request finished


def test_a_final_only_output_dates_ttft_by_the_engines_first_token() -> None:
    """Forty tokens reaching the tracker at once: TTFT is the engine's first-token time minus the
    arrival, whenever the output arrives, and the other 39 tokens are inter-token gaps."""
    metrics = ServerMetrics()
    arrival = time.monotonic() - 100.0  # the output arrives long after the first token
    tracker = metrics.tracker(arrival)
    completion = CompletionOutput(index=0, text="", token_ids=list(range(40)), finish_reason="length")
    tracker.observe(RequestOutput("r", None, [1, 2, 3], [completion], finished=True,
                                  metrics={"arrival_time": arrival, "first_token_time": arrival + 0.25}))
    sample = metrics.registry.get_sample_value
    assert sample("hybridserve_time_to_first_token_seconds_count") == 1
    assert sample("hybridserve_time_to_first_token_seconds_sum") == pytest.approx(0.25)
    assert sample("hybridserve_inter_token_latency_seconds_count") == 39
    assert sample("hybridserve_e2e_request_latency_seconds_count") == 1


# --------------------------------------------------------------------------- disconnects
def test_disconnect_mid_stream_frees_request(http: httpx.Client, engine: AsyncLLMEngine) -> None:
    wait_until(lambda: is_idle(engine))
    body = {"model": MODEL, "prompt": random_ids(4, 40), "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # keep the iterator: dropping it mid-way closes the connection
        assert next(lines).startswith("data: ")
        assert engine_stats(engine)["num_running"] == 1
    wait_until(lambda: is_idle(engine))


def test_disconnect_non_streaming_frees_request(server: ServerThread, engine: AsyncLLMEngine) -> None:
    wait_until(lambda: is_idle(engine))
    body = {"model": MODEL, "prompt": random_ids(5, 40), "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.5)
    wait_until(lambda: is_idle(engine))


# --------------------------------------------------------------------------- bad requests
LONG_PROMPT = [300] * (MAX_MODEL_LEN + 10)
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
OK_MSG = [{"role": "user", "content": "hi"}]

# (case id, method, path, json body or raw bytes, expected status, expected param or None)
BAD_REQUESTS: list[tuple[str, str, str, Any, int, str | None]] = [
    ("malformed-json", "POST", CMPL, b'{"model": "tiny", "prompt": ', 400, None),
    ("body-not-object", "POST", CMPL, [1, 2], 400, None),
    ("missing-prompt", "POST", CMPL, {"model": MODEL}, 400, "prompt"),
    ("negative-temperature", "POST", CMPL, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("string-temperature", "POST", CMPL, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("zero-max-tokens", "POST", CMPL, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("zero-n", "POST", CMPL, {"prompt": "hi", "n": 0}, 400, "n"),
    ("top-p-too-big", "POST", CMPL, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("empty-batched-prompt", "POST", CMPL, {"prompt": [[1, 2], []]}, 400, "prompt"),
    ("empty-prompt", "POST", CMPL, {"prompt": ""}, 400, "prompt"),
    ("token-out-of-vocab", "POST", CMPL, {"prompt": [1, 999999], "max_tokens": 1}, 400, None),
    ("prompt-too-long", "POST", CMPL, {"prompt": LONG_PROMPT, "max_tokens": 1}, 400, "prompt"),
    ("max-tokens-past-context", "POST", CMPL, {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("logprobs-too-many", "POST", CMPL, {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("stream-options-without-stream", "POST", CMPL, {"prompt": "hi", "stream_options": {"include_usage": True}},
     400, None),
    ("logit-bias-not-an-id", "POST", CMPL, {"prompt": "hi", "logit_bias": {"x": 10}}, 400, "logit_bias"),
    ("logit-bias-too-big", "POST", CMPL, {"prompt": "hi", "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    ("string-seed", "POST", CMPL, {"prompt": "hi", "seed": "7"}, 400, "seed"),
    ("empty-stop", "POST", CMPL, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("empty-cache-salt", "POST", CMPL, {"prompt": "hi", "cache_salt": ""}, 400, "cache_salt"),
    ("unknown-model", "POST", CMPL, {"model": "gpt-17", "prompt": "hi"}, 404, "model"),
    ("chat-no-messages", "POST", CHAT, {"messages": []}, 400, "messages"),
    ("chat-bad-role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("chat-image-part", "POST", CHAT,
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    ("chat-top-logprobs-alone", "POST", CHAT, {"messages": OK_MSG, "top_logprobs": 2}, 400, None),
    ("chat-tools", "POST", CHAT, {"messages": OK_MSG, "tools": [{"type": "function"}]}, 400, "tools"),
    ("unknown-route", "POST", "/v1/nope", {"prompt": "hi"}, 404, None),
    ("wrong-method", "GET", CMPL, None, 405, None),
]


def send_raw(http: httpx.Client, method: str, path: str, body: Any) -> httpx.Response:
    """Send a JSON body, or raw bytes as-is."""
    if isinstance(body, bytes):
        return http.request(method, path, content=body, headers={"content-type": "application/json"})
    return http.request(method, path, json=body) if body is not None else http.request(method, path)


def check_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    """Assert the status and the OpenAI error envelope; return the error object."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request(http: httpx.Client, case: tuple[str, str, str, Any, int, str | None]) -> None:
    name, method, path, body, status, param = case
    error = check_error(send_raw(http, method, path, body), status, param)
    if name == "prompt-too-long":
        assert str(MAX_MODEL_LEN) in error["message"]


def test_bad_requests_do_not_disturb_a_good_one(http: httpx.Client, client: openai.OpenAI,
                                                engine: AsyncLLMEngine) -> None:
    result: dict[str, Any] = {}

    def good() -> None:
        result["out"] = client.completions.create(model=MODEL, prompt="steady", max_tokens=8, temperature=0,
                                                  extra_body={"ignore_eos": True})

    worker = threading.Thread(target=good)
    worker.start()
    for _, method, path, body, status, param in BAD_REQUESTS:
        check_error(send_raw(http, method, path, body), status, param)
    worker.join(60)
    assert result["out"].usage.completion_tokens == 8
    wait_until(lambda: is_idle(engine))
    asyncio.run(engine.check_integrity())


# --------------------------------------------------------------------------- auth and limits
def test_api_key(restricted: ServerThread) -> None:
    url = restricted.url
    check_error(httpx.get(f"{url}/v1/models"), 401)
    check_error(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    assert ok.completions.create(model=MODEL, prompt="auth", max_tokens=1).usage.completion_tokens == 1


def test_body_too_large(restricted: ServerThread) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    big = json.dumps({"model": MODEL, "prompt": "x" * 5000}).encode()
    check_error(httpx.post(f"{restricted.url}/v1/completions", content=big, headers=headers), 413)

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    check_error(httpx.post(f"{restricted.url}/v1/completions", content=chunked(), headers=headers), 413)


def test_full_waiting_queue_answers_503() -> None:
    engine = AsyncLLMEngine(LLMEngine(tiny_config(max_num_seqs=1, max_waiting_requests=1)), max_waiting_requests=1)
    slow = {"model": MODEL, "prompt": "hold", "max_tokens": 500, "ignore_eos": True, "stream": True}
    quick = {"model": MODEL, "prompt": "queued", "max_tokens": 1}
    try:
        with ServerThread(build_app(engine, model_name=MODEL)) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=slow) as running:
                lines = running.iter_lines()  # keep the iterator: dropping it closes the connection
                assert next(lines).startswith("data: ")
                waiting: dict[str, httpx.Response] = {}
                worker = threading.Thread(target=lambda: waiting.update(r=c.post("/v1/completions", json=quick)))
                worker.start()
                wait_until(lambda: engine_stats(engine)["num_waiting"] == 1)
                response = c.post("/v1/completions", json=quick)
                check_error(response, 503)
                assert int(response.headers["retry-after"]) >= 1
            worker.join(60)  # closing the stream aborted the running request, so the queued one ran
            assert waiting["r"].status_code == 200
    finally:
        engine.shutdown()


def test_step_failure_fails_requests_and_keeps_serving(http: httpx.Client, engine: AsyncLLMEngine) -> None:
    wait_until(lambda: is_idle(engine))
    sync_engine = engine.engine
    original = sync_engine.step_groups

    def broken_step() -> list:
        sync_engine.step_groups = original
        raise RuntimeError("injected step failure")

    sync_engine.step_groups = broken_step
    body = {"model": MODEL, "prompt": "fail once", "max_tokens": 2}
    check_error(http.post("/v1/completions", json=body), 500)
    assert http.post("/v1/completions", json=body).status_code == 200

    sync_engine.step_groups = broken_step  # mid-stream: an error event, then [DONE]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert "error" in json.loads(lines[-2][6:]) and lines[-1] == "data: [DONE]"
    wait_until(lambda: is_idle(engine))


def test_concurrent_requests_share_batches(client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    sync_engine = engine.engine
    original = sync_engine.step_groups
    seen: list[int] = []

    def recording_step() -> list:
        seen.append(sync_engine.num_running_requests)
        return original()

    sync_engine.step_groups = recording_step
    try:
        def one(i: int) -> None:
            client.completions.create(model=MODEL, prompt=f"batch {i}", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})

        workers = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
    finally:
        sync_engine.step_groups = original
    assert max(seen) >= 2


def test_stream_interval_sends_tokens_in_chunks(engine: AsyncLLMEngine, http: httpx.Client) -> None:
    """`stream_interval=5`: the first token, then an output per 5 new tokens, then the last; the
    same tokens as a cumulative run. Through a server with `--stream-interval 4`, the streamed
    text is the non-streamed text in fewer chunks."""
    prompt = random_ids(11, 9)

    async def counts(interval: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True, stream_interval=interval)
        return [out.outputs[0].token_ids async for out in engine.generate(f"interval-{interval}", prompt, params)]

    every, chunked = asyncio.run(counts(1)), asyncio.run(counts(5))
    assert [len(ids) for ids in chunked] == [1, 6, 11, 16, 21, 23] and chunked[-1] == every[-1]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 13, "temperature": 0, "ignore_eos": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    with ServerThread(build_app(engine, model_name=MODEL, stream_interval=4)) as chunking:
        with httpx.stream("POST", f"{chunking.url}/v1/completions", json={**body, "stream": True}) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    texts = [event["choices"][0]["text"] for event in events]
    assert "".join(texts) == whole and len(events) <= 5  # tokens 1, 5, 9, 13 (+ a finish-only chunk)
    with pytest.raises(ValueError, match="stream_interval must be"):
        build_app(engine, model_name=MODEL, stream_interval=0)
    wait_until(lambda: is_idle(engine))


# --------------------------------------------------------------------------- CLI
def test_serve_arguments() -> None:
    args = build_parser().parse_args([])
    assert (args.host, args.port, args.model, args.max_body_bytes) == ("127.0.0.1", 8000, None, 4 * 1024 * 1024)
    config = engine_config_from_args(args)
    assert config.model is None and config.cache.snapshot_interval == 256 and config.scheduler.max_num_seqs == 32
    assert served_model_names(build_parser().parse_args(["/models/Qwen3.5-0.8B"])) == ["Qwen3.5-0.8B"]
    assert served_model_names(build_parser().parse_args(["--model", "/models/Qwen3.5-0.8B"])) == ["Qwen3.5-0.8B"]
    assert served_model_names(build_parser().parse_args(["Qwen/Qwen3.5-0.8B"])) == ["Qwen/Qwen3.5-0.8B"]
    aliased = build_parser().parse_args(["--served-model-name", "a", "b", "--model", "/m/x"])
    assert served_model_names(aliased) == ["a", "b"] and engine_config_from_args(aliased).model == "/m/x"
    assert "(default: 127.0.0.1)" in build_parser().format_help()
    assert args.stream_interval == 1
    check_http_arguments(build_parser().parse_args(["--stream-interval", "8"]))
    for bad in (["--stream-interval", "0"], ["--max-body-bytes", "0"]):
        with pytest.raises(ValueError, match="must be"):
            check_http_arguments(build_parser().parse_args(bad))


# --------------------------------------------------------------------------- multi-turn chat
def _chat_turns(client: openai.OpenAI, engine: AsyncLLMEngine, renderer_template: str | None,
                reply_tokens: int = 6) -> list[tuple[int, int, int, bool]]:
    """Four chat turns; per turn after the first: (cached, previous prompt, previous prompt +
    reply - 1, whether the new prompt starts with the previous prompt and reply tokens)."""
    from hybridserve.server.chat import ChatRenderer

    tokenizer = engine.engine.tokenizer
    renderer = ChatRenderer(renderer_template)
    messages = [{"role": "system", "content": "You serve hybrid models with a joint prefix cache. " * 12}]
    previous: tuple[list[int], str, int] | None = None  # prompt ids, reply text, reply tokens
    turns = []
    for question in ["What is a snapshot?", "And a block?", "Why both?", "Thanks!"]:
        messages.append({"role": "user", "content": question})
        prompt_ids = tokenizer.encode(renderer.render(messages))
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=reply_tokens,
                                               temperature=0)
        assert reply.usage.prompt_tokens == len(prompt_ids)
        if previous is not None:
            earlier, text, count = previous
            replayed = prompt_ids[len(earlier):len(earlier) + count]
            reproduced = (prompt_ids[:len(earlier)] == earlier
                          and tokenizer.decode(replayed, skip_special_tokens=False) == text)
            turns.append((reply.usage.prompt_tokens_details.cached_tokens, len(earlier),
                          len(earlier) + count - 1, reproduced))
        content = reply.choices[0].message.content or ""
        previous = (prompt_ids, content, reply.usage.completion_tokens)
        messages.append({"role": "assistant", "content": content})
    wait_until(lambda: is_idle(engine))
    return turns


def test_multi_turn_through_the_server_restores_the_end_of_the_previous_turn(client: openai.OpenAI) -> None:
    """Turn N+1 = turn N's prompt + the tokens the model generated + a new message restores exactly
    the end of turn N (prompt + reply - 1 tokens), a boundary inside a KV block. The generated ids
    come from an offline engine with the same weights (greedy is deterministic)."""
    offline = LLMEngine(tiny_config())
    history: list[int] = []
    for turn in range(4):
        prompt = history + random_ids(200 + turn, 37 + 5 * turn)
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0)
        if history:
            assert reply.usage.prompt_tokens_details.cached_tokens == len(history) - 1
        offline.add_request(f"turn-{turn}", prompt, SamplingParams(max_tokens=7, temperature=0.0))
        while offline.has_unfinished_requests():
            outputs = offline.step()
        generated = outputs[-1].outputs[0].token_ids
        assert offline.tokenizer.decode(generated) == reply.choices[0].text
        history = prompt + generated


def test_multi_turn_chat_with_a_thinking_template(client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    """The built-in Qwen3.5-style template opens `<think>` in the generation prompt but not in
    the history, so turn N+1 leaves turn N's path inside its last tokens: it still restores turn
    N's prompt mark (the last block boundary before its prompt end)."""
    block = engine.engine.config.cache.block_size
    for cached, previous_prompt, _, _ in _chat_turns(client, engine, engine.engine.tokenizer.chat_template):
        assert cached >= (previous_prompt - 1) // block * block - block


def test_completion_prompt_shapes_and_ignored_fields() -> None:
    """`prompt` takes each of its four shapes as that shape (its union is tried left to right, and
    strict members cannot both match); a token-id prompt is not scanned for nested unknown fields,
    while nested ones elsewhere are still found."""
    from pydantic import ValidationError

    from hybridserve.server.protocol import ChatCompletionRequest, CompletionRequest

    def prompt(value: Any) -> Any:
        return CompletionRequest.model_validate({"model": "m", "prompt": value}).prompt_inputs

    assert prompt("hi") == ["hi"]
    assert prompt([5, 6, 7]) == [[5, 6, 7]]
    assert prompt(["a", "b"]) == ["a", "b"]
    assert prompt([[1, 2], [3]]) == [[1, 2], [3]]
    for bad in ([1, "a"], [[1], "a"], [], [[]], [-1], 3.5):
        with pytest.raises(ValidationError):
            prompt(bad)
    ids = CompletionRequest.model_validate({"model": "m", "prompt": list(range(4096)), "foo": 1})
    assert ids.ignored_fields() == ["foo"]
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x", "bar": 2}], "baz": 3})
    assert sorted(chat.ignored_fields()) == ["baz", "messages[0].bar"]


def test_tier_stats_become_one_labelled_family_per_field() -> None:
    """The engine's `tier_<tier>_<field>` keys scrape as `hybridserve_tier_<field>{tier=...}`;
    unknown tier fields and non-tier keys are not turned into tier metrics."""
    from prometheus_client import CollectorRegistry, generate_latest

    from hybridserve.server.metrics import EngineStatsCollector

    collector = EngineStatsCollector()
    collector.stats = {"tier_host_hits": 3, "tier_disk_hits": 1, "tier_host_used_bytes": 100,
                       "tier_host_not_a_field": 7, "kv_blocks_free": 5}
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert 'hybridserve_tier_hits_total{tier="host"} 3.0' in text
    assert 'hybridserve_tier_hits_total{tier="disk"} 1.0' in text
    assert 'hybridserve_tier_used_bytes{tier="host"} 100.0' in text
    assert "not_a_field" not in text
    assert "# TYPE hybridserve_tier_used_bytes gauge" in text

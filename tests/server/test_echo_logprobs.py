"""`/v1/completions` with `echo` and `logprobs`: the prompt's tokens and logprobs first (OpenAI's
legacy layout, the first token's logprob null), then the completion's; `max_tokens: 0` with echo;
streaming; the prefix cache bypassed with a warm prefix present; bad values answered with a 400.
The prompt's logprobs are checked against transformers' log-softmax on a tiny checkpoint."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from hybridserve.config import EngineConfig
from hybridserve.engine.async_engine import AsyncLLMEngine
from hybridserve.engine.engine import LLMEngine
from hybridserve.models.tokenizer import Tokenizer
from hybridserve.server.app import build_app
from tests.helpers.checkpoints import reference_text_model
from tests.helpers.live_server import ServerThread, is_idle, tiny_config, wait_until

MODEL = "tiny"
ATOL = 1e-4  # CPU float32 against transformers (tests/README.md)
CMPL = "/v1/completions"

pytestmark = pytest.mark.timeout(180)


def checkpoint_config(path: Path, **scheduler: Any) -> EngineConfig:
    """The server tests' small engine, on a checkpoint (prefix cache on, chunked prefill)."""
    config = tiny_config(**scheduler)
    return EngineConfig(model=str(path), device=config.device, dtype=config.dtype, cache=config.cache,
                        scheduler=config.scheduler)


@pytest.fixture(scope="module")
def engine(text_checkpoint: Path) -> Iterator[AsyncLLMEngine]:
    async_engine = AsyncLLMEngine(LLMEngine(checkpoint_config(text_checkpoint, max_num_batched_tokens=32)),
                                  max_waiting_requests=64)
    yield async_engine
    async_engine.shutdown()


@pytest.fixture(scope="module")
def server(engine: AsyncLLMEngine) -> Iterator[ServerThread]:
    with ServerThread(build_app(engine, model_name=MODEL, api_key=None)) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(text_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(text_checkpoint)


@pytest.fixture(scope="module")
def reference(text_checkpoint: Path) -> torch.nn.Module:
    return reference_text_model(text_checkpoint)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(300, 4096, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Row i: log-softmax of the logits after ids[: i + 1]."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_echoed_prompt(logprobs: dict[str, Any], prompt: list[int], ref: torch.Tensor, k: int,
                         tokenizer: Tokenizer) -> None:
    """The first len(prompt) entries are the prompt's: its token texts, logprobs within ATOL of
    the reference (null first), the top-k by text, offsets from 0."""
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in prompt]
    n = len(prompt)
    assert logprobs["tokens"][:n] == texts
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    offsets = [sum(len(t) for t in texts[:i]) for i in range(n)]
    assert logprobs["text_offset"][:n] == offsets
    for position in range(1, n):
        expected = ref[position - 1]
        assert abs(logprobs["token_logprobs"][position] - expected[prompt[position]].item()) <= ATOL, position
        top = expected.topk(k)
        want = {tokenizer.decode([t], skip_special_tokens=False): v
                for t, v in zip(top.indices.tolist(), top.values.tolist())} if k else {}
        got = logprobs["top_logprobs"][position]
        assert got.keys() == want.keys(), position
        assert all(abs(got[t] - want[t]) <= ATOL for t in got)


def assert_logprobs_close(got: dict[str, list[Any]], want: dict[str, list[Any]]) -> None:
    """The same tokens, offsets and top-k texts; logprobs within ATOL (None where None)."""
    assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
    for value, expected in zip(got["token_logprobs"], want["token_logprobs"], strict=True):
        assert (value is None and expected is None) or abs(value - expected) <= ATOL
    for top, expected_top in zip(got["top_logprobs"], want["top_logprobs"], strict=True):
        if top is None or expected_top is None:
            assert top is expected_top
            continue
        assert top.keys() == expected_top.keys() and all(abs(top[t] - expected_top[t]) <= ATOL for t in top)


def settle(engine: AsyncLLMEngine) -> None:
    """Wait until nothing is held, then run the pool integrity checks."""
    wait_until(lambda: is_idle(engine))
    asyncio.run(engine.check_integrity())


def test_echo_with_logprobs(http: httpx.Client, engine: AsyncLLMEngine, reference: torch.nn.Module,
                            tokenizer: Tokenizer) -> None:
    prompt = _prompt(70, seed=1)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = http.post(CMPL, json={**body, "logprobs": 2}).json()["choices"][0]
    response = http.post(CMPL, json={**body, "logprobs": 2, "echo": True})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt) + 3
    assert_echoed_prompt(logprobs, prompt, reference_logprobs(reference, prompt), 2, tokenizer)
    echo = tokenizer.decode(prompt)
    assert choice["text"] == echo + plain["text"]
    # the completion's part is what the request without echo returns (its prefill may take another
    # backend: equal within ATOL), its offsets after the echo
    completion = {key: values[len(prompt):] for key, values in logprobs.items()}
    assert completion["text_offset"] == [len(echo) + o for o in plain["logprobs"]["text_offset"]]
    assert_logprobs_close({**completion, "text_offset": plain["logprobs"]["text_offset"]}, plain["logprobs"])
    assert response.json()["usage"]["completion_tokens"] == 3
    settle(engine)


def test_echo_with_max_tokens_zero(http: httpx.Client, engine: AsyncLLMEngine, reference: torch.nn.Module,
                                   tokenizer: Tokenizer) -> None:
    """What lm-evaluation-harness's loglikelihood requests look like, batched: the prompt alone."""
    prompts = [_prompt(25, seed=2), _prompt(48, seed=3)]
    response = http.post(CMPL, json={"model": MODEL, "prompt": prompts, "max_tokens": 0, "echo": True,
                                     "logprobs": 1, "temperature": 0})
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["usage"]["completion_tokens"] == 0
    assert data["usage"]["prompt_tokens"] == sum(map(len, prompts))
    for prompt, choice in zip(prompts, sorted(data["choices"], key=lambda c: c["index"])):
        assert choice["text"] == tokenizer.decode(prompt) and choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["tokens"]) == len(prompt)
        assert_echoed_prompt(choice["logprobs"], prompt, reference_logprobs(reference, prompt), 1, tokenizer)
    plain = http.post(CMPL, json={"model": MODEL, "prompt": "Echo me", "max_tokens": 0, "echo": True}).json()
    assert plain["choices"][0]["text"] == "Echo me" and plain["choices"][0]["logprobs"] is None
    settle(engine)


def test_echo_of_a_text_prompt_with_the_openai_client(server: ServerThread, reference: torch.nn.Module,
                                                      tokenizer: Tokenizer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    text = "The joint prefix cache keeps states"
    out = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=3)
    choice = out.choices[0]
    assert choice.text == text and choice.logprobs is not None
    ids = tokenizer.encode(text)
    assert choice.logprobs.token_logprobs is not None and choice.logprobs.token_logprobs[0] is None
    assert_echoed_prompt(choice.logprobs.model_dump(), ids, reference_logprobs(reference, ids), 3, tokenizer)


def test_echo_bypasses_a_warm_prefix(http: httpx.Client, engine: AsyncLLMEngine, reference: torch.nn.Module,
                                     tokenizer: Tokenizer) -> None:
    """A cached prefix is not restored for a request that needs its prompt's logprobs (there are
    no logits for cached tokens); plain requests still hit it afterwards."""
    prompt = _prompt(150, seed=4)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    http.post(CMPL, json=body)
    warm = http.post(CMPL, json=body).json()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    scored = http.post(CMPL, json={**body, "echo": True, "logprobs": 1}).json()
    assert scored["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert_echoed_prompt(scored["choices"][0]["logprobs"], prompt, reference_logprobs(reference, prompt), 1, tokenizer)
    assert scored["choices"][0]["text"].endswith(warm["choices"][0]["text"])
    again = http.post(CMPL, json=body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["text"] == warm["choices"][0]["text"]
    settle(engine)


def _stream(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with http.stream("POST", CMPL, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def _joined(chunks: list[dict[str, Any]]) -> tuple[str, dict[str, list[Any]], str | None]:
    """A stream's text, logprobs and finish reason, put together."""
    text, joined, finish = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            text += choice["text"]
            for key in joined:
                joined[key] += (choice["logprobs"] or {}).get(key, [])
            finish = choice["finish_reason"] or finish
    return text, joined, finish


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_streamed_echo_with_logprobs(http: httpx.Client, engine: AsyncLLMEngine, max_tokens: int) -> None:
    """A stream carries the echoed prompt and its logprobs in its first chunk, then the
    completion's; put together, it equals the JSON response."""
    body = {"model": MODEL, "prompt": _prompt(40, seed=5), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "echo": True, "logprobs": 2, "stream_options": {"include_usage": True}}
    whole = http.post(CMPL, json={k: v for k, v in body.items() if k != "stream_options"}).json()
    chunks = _stream(http, body)
    text, logprobs, finish = _joined(chunks)
    assert text == whole["choices"][0]["text"] and finish == whole["choices"][0]["finish_reason"]
    assert_logprobs_close(logprobs, whole["choices"][0]["logprobs"])
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None
    assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
    settle(engine)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0, "logprobs": 1}, "max_tokens"),
    ({"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "echo": True, "logprobs": -1}, "logprobs"),
    ({"prompt": "hi", "echo": True, "max_tokens": -1}, "max_tokens"),
])
def test_bad_echo_requests(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    response = http.post(CMPL, json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param

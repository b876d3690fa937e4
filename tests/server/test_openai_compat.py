"""Acceptance against a live server with the official `openai` client (sync, async, streaming):
batched completions, chat with n and logprobs, `.parse()` with a Pydantic model, forced tool
calls, reasoning_content, cached_tokens, every field of the chat schema, the extra endpoints and
the `serve` start-up failures."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from pydantic import BaseModel, Field

from hybridserve.engine.async_engine import AsyncLLMEngine
from hybridserve.engine.engine import LLMEngine
from hybridserve.engine_args import engine_config_from_args
from hybridserve.server.app import build_app
from hybridserve.server.cli import build_parser
from tests.helpers.live_server import ServerThread, tiny_config

MODEL = "tiny"
ALIAS = "tiny-alias"
SYSTEM = {"role": "system", "content": "You answer questions about the hybridserve engine. " * 30}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                                       "required": ["zone"]}}}

pytestmark = pytest.mark.timeout(300)


class Point(BaseModel):
    """The structured answer `.parse()` must return."""

    x: int = Field(ge=0, le=99)
    label: str = Field(max_length=8)
    ok: bool


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    engine = AsyncLLMEngine(LLMEngine(tiny_config()), max_waiting_requests=64)
    app = build_app(engine, model_name=[MODEL, ALIAS], reasoning_parser="qwen3")
    with ServerThread(app) as srv:
        yield srv
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _check_weather_arguments(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) <= {"city", "days", "unit"} and {"city", "days"} <= set(args)
    assert isinstance(args["city"], str) and 1 <= len(args["city"]) <= 12
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 7
    assert args.get("unit", "celsius") in ("celsius", "fahrenheit")


def test_batched_completions_are_prompt_major(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "max_tokens": 4, "temperature": 1.0, "seed": 3, "n": 2}
    batch = client.completions.create(prompt=["First prompt", "Second one"], **kwargs)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    alone = client.completions.create(prompt="Second one", **kwargs)
    assert [c.text for c in batch.choices[2:]] == [c.text for c in alone.choices]
    ids = client.completions.create(model=MODEL, prompt=[[300, 301, 302], [400]], max_tokens=2, temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 4


def test_chat_with_n_and_logprobs_and_cached_tokens(client: openai.OpenAI) -> None:
    messages = [SYSTEM, {"role": "user", "content": "What is a snapshot?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=4, temperature=1.0,
                                           seed=1, logprobs=True, top_logprobs=2)
    assert [c.index for c in first.choices] == [0, 1, 2]
    for choice in first.choices:
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert first.usage.completion_tokens == sum(len(c.logprobs.content) for c in first.choices)
    again = client.chat.completions.create(model=ALIAS, messages=messages, n=3, max_tokens=4, temperature=1.0,
                                           seed=1)
    assert again.model == ALIAS and again.usage.prompt_tokens_details.cached_tokens >= 256
    assert [c.message.reasoning_content for c in again.choices] == \
        [c.message.reasoning_content for c in first.choices]


def test_parse_returns_a_pydantic_object(client: openai.OpenAI) -> None:
    for attempt in range(2):
        completion = client.chat.completions.parse(
            model=MODEL, messages=[SYSTEM, {"role": "user", "content": "Give me a point."}],
            response_format=Point, max_tokens=80, temperature=1.0, seed=attempt)
        point = completion.choices[0].message.parsed
        assert isinstance(point, Point) and 0 <= point.x <= 99
        assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.prompt_tokens_details.cached_tokens >= 256  # the grammar does not stop caching


def test_required_and_named_tool_calls(client: openai.OpenAI) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Weather in Paris for three days?"}]
    required = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                              tool_choice="required", parallel_tool_calls=False,
                                              max_tokens=120, temperature=0.7, seed=2)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name in ("get_weather", "get_time") and call.id
    if call.function.name == "get_weather":
        _check_weather_arguments(call.function.arguments)
    named = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           max_tokens=120, temperature=1.0, seed=4)
    calls = named.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"]
    _check_weather_arguments(calls[0].function.arguments)
    assert named.usage.prompt_tokens_details.cached_tokens >= 256
    # a tool call and its result go back into the conversation
    follow_up = messages + [named.choices[0].message.model_dump(exclude_none=True),
                            {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}]
    answer = client.chat.completions.create(model=MODEL, messages=follow_up, tools=[WEATHER], max_tokens=3)
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_streamed_tool_call(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=120, temperature=1.0,
        seed=5, stream=True)
    name, arguments, finish = "", "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or []:
            assert call.index == 0
            name += call.function.name or ""
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert name == "get_weather" and finish == "tool_calls"
    _check_weather_arguments(arguments)


def test_streamed_tool_call_arguments_come_in_pieces_the_client_assembles(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER],
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 120,
              "temperature": 1.0, "seed": 5}
    state = ChatCompletionStreamState()
    argument_pieces = 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        state.handle_chunk(chunk)
        for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            argument_pieces += bool(call.function and call.function.arguments)
            assert (call.id is not None) == (call.function.name is not None)  # id, type and name come first
    streamed = state.get_final_completion().choices[0].message.tool_calls
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    assert argument_pieces >= 2  # one parameter at a time, then the closing brace
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in whole]
    _check_weather_arguments(streamed[0].function.arguments)


def test_forced_tool_calls_never_leak_markup(client: openai.OpenAI) -> None:
    # tool_choice "required" with the default parallel_tool_calls: calls follow each other until
    # max_tokens cuts one; its markup must not turn into content, streamed or not
    finishes = []
    for seed in range(4):
        kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "What time is it?"}],
                  "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 40, "temperature": 1.0,
                  "seed": seed}
        whole = client.chat.completions.create(**kwargs).choices[0]
        assert not whole.message.content and whole.message.tool_calls
        state = ChatCompletionStreamState()
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            state.handle_chunk(chunk)
            for choice in chunk.choices:
                assert "<" not in (choice.delta.content or "")
        streamed = state.current_completion_snapshot.choices[0]  # the final parse refuses a "length" finish
        assert not streamed.message.content and streamed.finish_reason == whole.finish_reason
        assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []] == \
            [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        for call in whole.message.tool_calls:
            json.loads(call.function.arguments)
        finishes.append(whole.finish_reason)
    assert "length" in finishes  # the case that leaked: a call cut by max_tokens


def test_reasoning_content(client: openai.OpenAI, server: ServerThread) -> None:
    messages = [{"role": "user", "content": "Think first."}]
    kwargs = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    thought = client.chat.completions.create(**kwargs)
    prompt = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    raw = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    assert thought.choices[0].message.reasoning_content == raw.strip("\n")  # no </think>: all of it is thinking
    assert thought.choices[0].message.content == ""
    streamed = list(client.chat.completions.create(stream=True, **kwargs))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in streamed)
    assert reasoning == thought.choices[0].message.reasoning_content
    plain = client.chat.completions.create(extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **kwargs)
    assert plain.choices[0].message.reasoning_content == "" and plain.choices[0].message.content


def test_async_client_and_streaming(server: ServerThread) -> None:
    async def run() -> tuple[str, str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as aclient:
            kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
                      "temperature": 0, "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
            whole = await aclient.chat.completions.create(**kwargs)
            parts = [c.choices[0].delta.content or "" async for c in await aclient.chat.completions.create(
                stream=True, **kwargs) if c.choices]
            return whole.choices[0].message.content, "".join(parts)

    whole, streamed = asyncio.run(run())
    assert whole and whole == streamed


ALL_CHAT_FIELDS = {
    "model": MODEL, "messages": [{"role": "developer", "content": "Be brief.", "name": "dev"},
                                 {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    "audio": None, "frequency_penalty": 0.1, "function_call": "auto", "functions": [], "logit_bias": {"300": 1.5},
    "logprobs": True, "max_completion_tokens": 4, "max_tokens": 4, "metadata": {"k": "v"}, "modalities": ["text"],
    "n": 2, "parallel_tool_calls": True, "prediction": None, "presence_penalty": 0.1,
    "prompt_cache_key": "abc", "reasoning_effort": "low", "response_format": {"type": "text"},
    "safety_identifier": "s1", "seed": 1, "service_tier": "auto", "stop": ["\n\n\n"], "store": False,
    "stream": False, "stream_options": None, "temperature": 0.5, "tool_choice": "auto",
    "tools": [WEATHER], "top_logprobs": 2, "top_p": 0.9, "user": "u1", "verbosity": "low",
    "web_search_options": {}, "prompt_cache_retention": "in-memory",
    # vLLM extras
    "top_k": 50, "min_p": 0.01, "repetition_penalty": 1.05, "min_tokens": 1, "ignore_eos": False,
    "skip_special_tokens": True, "include_stop_str_in_output": False, "stop_token_ids": [],
    "chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": True, "cache_salt": "t1",
    "priority": 0, "echo": False, "documents": None, "request_id": "r1",
}


def test_every_chat_field_is_accepted(server: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hybridserve.server.serving"):
        response = httpx.post(f"{server.url}/v1/chat/completions", json=ALL_CHAT_FIELDS, timeout=120)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2
    lines = [r.getMessage() for r in caplog.records if "ignored unknown field" in r.getMessage()]
    assert len(lines) == 1 and "audio" in lines[0] and "web_search_options" in lines[0] and "priority" in lines[0]
    bad = dict(ALL_CHAT_FIELDS, temperature="hot")  # a supported field is still validated strictly
    assert httpx.post(f"{server.url}/v1/chat/completions", json=bad).status_code == 400


def test_extra_endpoints(server: ServerThread) -> None:
    url = server.url
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) and "".join(tokens["token_strs"]) == "Hello world"
    assert httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hello world"}
    assert httpx.post(f"{url}/detokenize", json={"tokens": [10**9]}).status_code == 400
    assert httpx.get(f"{url}/version").json()["version"]
    assert httpx.get(f"{url}/v1/models/{ALIAS}").json()["id"] == ALIAS
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [MODEL, ALIAS]
    assert httpx.get(f"{url}/v1/models/other").status_code == 404


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridserve.cli", "serve", *args], capture_output=True,
                          text=True, timeout=120, check=False)  # the exit code is what is tested


def test_serve_start_up_failures_exit_non_zero() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = _serve("--port", str(taken.getsockname()[1]), "--log-level", "error")
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "cannot listen on" in errors[0]
    missing = _serve("--model", "/nonexistent/model-dir", "--log-level", "error")
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    with pytest.raises(ValueError, match="two different models"):
        engine_config_from_args(build_parser().parse_args(["/a", "--model", "/b"]))

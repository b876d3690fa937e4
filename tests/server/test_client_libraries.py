"""Other client libraries that applications use against OpenAI-compatible servers, each doing a
chat, a streamed chat and a structured / tool call against a live server: LangChain's
`ChatOpenAI` and LiteLLM (test extras)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from pydantic import BaseModel, Field

from hybridserve.engine.async_engine import AsyncLLMEngine
from hybridserve.engine.engine import LLMEngine
from hybridserve.server.app import build_app
from tests.helpers.live_server import ServerThread, tiny_config

MODEL = "tiny"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}

pytestmark = pytest.mark.timeout(300)


class Answer(BaseModel):
    """A structured answer."""

    score: int = Field(ge=0, le=9)
    word: str = Field(max_length=6)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    engine = AsyncLLMEngine(LLMEngine(tiny_config()), max_waiting_requests=64)
    with ServerThread(build_app(engine, model_name=MODEL, reasoning_parser="qwen3")) as srv:
        yield srv
    engine.shutdown()


def test_langchain_chat_stream_structured_and_tools(server: ServerThread) -> None:
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_openai import ChatOpenAI

    def model(max_tokens: int) -> ChatOpenAI:
        return ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="unused", max_tokens=max_tokens,
                          temperature=0, max_retries=0, extra_body=NO_THINKING)

    chat = model(6)
    reply = chat.invoke([HumanMessage("Hello there")])
    assert isinstance(reply, AIMessage) and isinstance(reply.content, str) and reply.content
    streamed = "".join(chunk.content for chunk in chat.stream([HumanMessage("Hello there")]))
    assert streamed == reply.content

    structured = model(60).with_structured_output(Answer, method="json_schema")
    answer = structured.invoke("Score this.")
    assert isinstance(answer, Answer) and 0 <= answer.score <= 9

    with_tools = model(60).bind_tools([WEATHER], tool_choice="get_weather")
    called = with_tools.invoke("Weather in Oslo?")
    assert [c["name"] for c in called.tool_calls] == ["get_weather"]
    assert isinstance(called.tool_calls[0]["args"]["city"], str)


def test_litellm_chat_stream_structured_and_tools(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the cost map at import
    import litellm

    common = {"model": f"openai/{MODEL}", "api_base": f"{server.url}/v1", "api_key": "unused",
              "temperature": 0, "extra_body": NO_THINKING}
    messages = [{"role": "user", "content": "Hello there"}]
    reply = litellm.completion(messages=messages, max_tokens=6, **common)
    text = reply.choices[0].message.content
    assert isinstance(text, str) and text
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       litellm.completion(messages=messages, max_tokens=6, stream=True, **common))
    assert streamed == text

    structured = litellm.completion(messages=[{"role": "user", "content": "Score this."}], max_tokens=60,
                                    response_format=Answer, **common)
    assert Answer.model_validate_json(structured.choices[0].message.content).score <= 9

    called = litellm.completion(messages=[{"role": "user", "content": "Weather?"}], max_tokens=60, tools=[WEATHER],
                                tool_choice="required", parallel_tool_calls=False, **common)
    calls = called.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"]
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)

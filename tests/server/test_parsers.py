"""Tool-call parser (Qwen3.5 XML and Hermes JSON), its streaming form, the forced-call grammar and
the qwen3 reasoning parser."""

from __future__ import annotations

import json

import pytest

from hybridserve.server.reasoning_parser import ReasoningStream, prompt_opens_thinking, split_reasoning
from hybridserve.server.tool_grammar import tool_call_grammar
from hybridserve.server.tool_parser import ToolCallStream, parse_tool_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}}, "required": ["city"]}}}]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, CA\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>")


def test_complete_xml_call_with_typed_arguments() -> None:
    parsed = parse_tool_calls("Let me check.\n" + CALL, TOOLS)
    assert parsed.content == "Let me check."
    assert [c.name for c in parsed.tool_calls] == ["get_weather"]
    assert json.loads(parsed.tool_calls[0].arguments) == {"city": "San Francisco, CA", "days": 3, "metric": True}


def test_several_calls_and_hermes_json() -> None:
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    parsed = parse_tool_calls(CALL + "\n" + hermes, TOOLS)
    assert parsed.content == "" and len(parsed.tool_calls) == 2
    assert json.loads(parsed.tool_calls[1].arguments) == {"city": "Oslo"}


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis",     # never closed
    "<tool_call>not a call</tool_call>",                                # closed, unparseable
    "<tool_call>{\"arguments\": {}}</tool_call>",                       # JSON without a name
    "<tool_call><function=f>junk<parameter=a>1</parameter></function></tool_call>",  # stray text
    "plain text with </tool_call> and <function=x>",
])
def test_malformed_markup_stays_plain_text(text: str) -> None:
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.tool_calls == [] and parsed.content == text


def test_streaming_deltas_rebuild_the_message() -> None:
    text = "Sure, one moment. " + CALL + " done"
    for step in (1, 3, 7, 50):
        stream = ToolCallStream(TOOLS)
        content, calls = "", []
        for end in range(0, len(text), step):
            delta = stream.update(text[:end], final=False)
            content += delta.content
            calls += delta.tool_calls
            assert "<tool" not in content  # a call in progress is never leaked as content
        delta = stream.update(text, final=True)
        content += delta.content
        calls += delta.tool_calls
        assert content == "Sure, one moment.  done"
        assert [(i, c.name) for i, c in calls] == [(0, "get_weather")]


def test_streaming_unclosed_call_is_flushed_as_content_at_the_end() -> None:
    stream = ToolCallStream(TOOLS)
    partial = "Hi <tool_call>\n<function=get_weather>\n"
    assert stream.update(partial, final=False).content == "Hi "
    final = stream.update(partial, final=True)
    assert final.content == partial[3:] and final.tool_calls == []


def test_forced_grammar_markup_round_trips_through_the_parser() -> None:
    grammar = tool_call_grammar(TOOLS, only="get_weather")
    assert "<parameter=city>" in grammar and "p0_1?" in grammar  # days optional, city required
    with pytest.raises(ValueError):
        tool_call_grammar(TOOLS, only="missing")


def test_reasoning_split() -> None:
    assert split_reasoning("plan it\n</think>\n\nThe answer", thinking_open=True) == ("plan it", "The answer")
    assert split_reasoning("<think>plan</think>answer", thinking_open=False) == ("plan", "answer")
    assert split_reasoning("no thinking here", thinking_open=False) == ("", "no thinking here")
    assert split_reasoning("cut short", thinking_open=True) == ("cut short", "")
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_reasoning_stream_holds_back_a_partial_end_tag() -> None:
    text = "thinking hard</think>\n\nanswer"
    stream = ReasoningStream(thinking_open=True)
    reasoning = ""
    for end in range(len(text)):
        delta, content = stream.update(text[:end], final=False)
        reasoning += delta
        assert "<" not in reasoning
    delta, content = stream.update(text, final=True)
    assert reasoning + delta == "thinking hard" and content == "answer"

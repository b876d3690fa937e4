"""Tool-call parser (Qwen3.5 XML and Hermes JSON), its streaming form, the forced-call grammar and
the qwen3 reasoning parser."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hybridserve.server.reasoning_parser import ReasoningStream, prompt_opens_thinking, split_reasoning
from hybridserve.server.tool_grammar import tool_call_grammar
from hybridserve.server.tool_parser import ToolCallStream, parse_forced_tool_calls, parse_tool_calls

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


def _feed(stream: ToolCallStream, text: str, step: int, leaks: bool = False) -> tuple[str, list[list[Any]]]:
    """Feed `text` in pieces of `step` characters; (content, [[name, joined arguments, pieces]])."""
    content, calls = "", []
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for number, piece in enumerate(pieces):
        delta = stream.update(piece, final=number == len(pieces) - 1)
        content += delta.content
        if not leaks:  # a call in progress is never sent as content
            assert "<tool" not in content and "<function" not in content
        for part in delta.tool_calls:
            if part.name is not None:
                assert part.call_index == len(calls)
                calls.append([part.name, "", 0])
            calls[part.call_index][1] += part.arguments
            calls[part.call_index][2] += 1
    return content, calls


@pytest.mark.parametrize("step", [1, 3, 7, 50, 10_000])
def test_streaming_deltas_rebuild_the_message(step: int) -> None:
    text = "Sure, one moment. " + CALL + " done"
    content, calls = _feed(ToolCallStream(TOOLS), text, step)
    assert content == "Sure, one moment.  done"
    assert [(name, json.loads(arguments)) for name, arguments, _ in calls] == \
        [("get_weather", {"city": "San Francisco, CA", "days": 3, "metric": True})]
    assert calls[0][1] == parse_tool_calls(text, TOOLS).tool_calls[0].arguments  # the same JSON text


def test_streamed_arguments_come_in_pieces_whose_join_is_the_arguments() -> None:
    stream = ToolCallStream(TOOLS)
    first = stream.update("<tool_call>\n<function=get_weather>\n<parameter=ci", final=False)
    assert [(p.call_index, p.name, p.arguments) for p in first.tool_calls] == [(0, "get_weather", "")]
    second = stream.update("ty>\nOslo\n</parameter>\n", final=False)
    assert [(p.name, p.arguments) for p in second.tool_calls] == [(None, '{"city": "Oslo"')]
    third = stream.update("<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>", final=False)
    assert [(p.name, p.arguments) for p in third.tool_calls] == [(None, ', "days": 2}')]


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_stream_agrees_with_the_whole_text_parser(step: int) -> None:
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    text = "a " + CALL + " b " + hermes + " c <tool_call>not a call</tool_call> d <tool_c"
    content, calls = _feed(ToolCallStream(TOOLS), text, step, leaks=True)  # malformed blocks stay content
    whole = parse_tool_calls(text, TOOLS, strip=False)
    assert content == whole.content
    assert [(name, arguments) for name, arguments, _ in calls] == [tuple(c) for c in whole.tool_calls]


def test_streaming_unclosed_block_without_a_function_is_flushed_as_content_at_the_end() -> None:
    stream = ToolCallStream(TOOLS)
    partial = "Hi <tool_call>\n<function=get_wea"
    assert stream.update(partial, final=False).content == "Hi "
    final = stream.update("", final=True)
    assert final.content == partial[3:] and final.tool_calls == []


def test_a_call_cut_short_is_closed_with_the_parameters_it_completed() -> None:
    cut = CALL[:CALL.index("<parameter=metric>") + 20]  # the third parameter is cut mid-value
    content, calls = _feed(ToolCallStream(TOOLS), "Hi " + cut, 5)
    assert content == "Hi "
    assert [(n, json.loads(a)) for n, a, _ in calls] == [("get_weather", {"city": "San Francisco, CA", "days": 3})]


@pytest.mark.parametrize("cut", [5, 40, 90, len(CALL) - 3])
def test_forced_calls_never_leak_markup_even_cut_short(cut: int) -> None:
    text = CALL + "\n" + CALL[:cut]
    content, calls = _feed(ToolCallStream(TOOLS, forced=True), text, 3)
    assert content == ""
    parsed = parse_forced_tool_calls(text, TOOLS)
    assert [(n, a) for n, a, _ in calls] == [tuple(c) for c in parsed]
    assert parsed[0] == parse_tool_calls(CALL, TOOLS).tool_calls[0] and 1 <= len(parsed) <= 2
    for call in parsed:
        assert json.loads(call.arguments).get("city", "San Francisco, CA") == "San Francisco, CA"


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
    reasoning, content = "", ""
    for char in text[:-1]:
        delta, new_content = stream.update(char, final=False)
        reasoning, content = reasoning + delta, content + new_content
        assert "<" not in reasoning
    delta, new_content = stream.update(text[-1], final=True)
    assert reasoning + delta == "thinking hard" and content + new_content == "answer"


@pytest.mark.parametrize("text,thinking_open", [
    ("plan it\n</think>\n\nThe answer", True), ("\n<think>\nplan</think>answer\n", False),
    ("no thinking here", False), ("cut short\n\n", True), ("<thi", False), ("\n\nA\n\nB</think>\n\nC\n", True),
])
@pytest.mark.parametrize("step", [1, 2, 5, 100])
def test_reasoning_stream_agrees_with_the_whole_text_split(text: str, thinking_open: bool, step: int) -> None:
    stream = ReasoningStream(thinking_open)
    reasoning, content = "", ""
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for number, piece in enumerate(pieces):
        delta, new_content = stream.update(piece, final=number == len(pieces) - 1)
        reasoning, content = reasoning + delta, content + new_content
    whole = split_reasoning(text, thinking_open)
    assert (reasoning, content) == (whole.reasoning.rstrip("\n"), whole.content)  # a stream drops trailing newlines


@pytest.mark.timeout(60)
def test_streams_do_bounded_work_per_piece() -> None:
    # a long string argument and long reasoning, fed a character at a time: re-parsing the whole
    # text each step (what a quadratic stream does) would not finish in the time limit
    value = "x" * 200_000
    text = f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{value}\n</parameter>\n</function>\n</tool_call>"
    content, calls = _feed(ToolCallStream(TOOLS), text, 1)
    assert content == "" and json.loads(calls[0][1]) == {"city": value}
    stream = ReasoningStream(thinking_open=True)
    reasoning = "".join(stream.update(char, final=False).reasoning for char in value)
    assert reasoning + stream.update("</think>", final=True).reasoning == value

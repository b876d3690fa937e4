"""Qwen3.5 tool-call markup (`<tool_call><function=NAME><parameter=K>V</parameter>...`, V raw text
for string parameters and JSON otherwise; or Hermes' JSON form) -> OpenAI `tool_calls`. A block
that does not close or parse stays content: parsing never raises. `ToolCallStream` parses a stream.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


class ParsedToolCall(NamedTuple):
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCallParse(NamedTuple):
    """Text outside complete tool-call blocks, and the calls, in order."""

    content: str
    tool_calls: list[ParsedToolCall]


def parameter_types(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """{function name: {parameter name: its JSON schema}} from OpenAI-style tool specs."""
    types: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        function = tool.get("function") or {}
        properties = (function.get("parameters") or {}).get("properties") or {}
        if isinstance(function.get("name"), str) and isinstance(properties, Mapping):
            types[function["name"]] = dict(properties)
    return types


def _convert_value(raw: str, schema: Mapping[str, Any] | None) -> Any:
    """A parameter's text as the type its schema declares (strings stay raw text)."""
    kinds = (schema or {}).get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "string" in kinds and len(kinds) == 1:
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def parse_block(body: str, types: Mapping[str, Mapping[str, Any]]) -> ParsedToolCall | None:
    """The call inside one `<tool_call>` block, or None if it is not well formed."""
    match = _FUNCTION.match(body)
    if match is not None:
        name = match.group(1).strip()
        schemas = types.get(name, {})
        inner = match.group(2)
        arguments = {key.strip(): _convert_value(value, schemas.get(key.strip()))
                     for key, value in _PARAMETER.findall(inner)}
        if _PARAMETER.sub("", inner).strip():
            return None  # stray text between parameters
        return ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False))
    try:  # Hermes' form: {"name": ..., "arguments": {...} or its JSON text}
        call = json.loads(body)
        given = call.get("arguments", call.get("parameters", {})) if isinstance(call, dict) else None
        given = json.loads(given) if isinstance(given, str) else given
    except json.JSONDecodeError:
        return None
    if not isinstance(given, dict) or not isinstance(call.get("name"), str):
        return None
    return ParsedToolCall(call["name"], json.dumps(given, ensure_ascii=False))


def stream_delta(sent: str, text: str) -> tuple[str, str]:
    """(what `text` adds to `sent`, the new sent text); nothing when `text` does not extend `sent`."""
    return (text[len(sent):], text) if text.startswith(sent) else ("", sent)


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def parse_tool_calls(text: str, tools: Sequence[Mapping[str, Any]] | None = None, *,
                     final: bool = True, strip: bool = True) -> ToolCallParse:
    """Split `text` into content and tool calls. With `final=False` (a stream in progress) the
    content stops before an unclosed block or a partial `<tool_call>` marker, which may still
    turn into a call; with `final=True` such a remainder is content. `strip` trims the
    whitespace around calls from the content (not for streams, whose content only grows)."""
    types = parameter_types(tools)
    content: list[str] = []
    calls: list[ParsedToolCall] = []
    position = 0
    while True:
        start = text.find(TOOL_CALL_START, position)
        if start < 0:
            tail = text[position:]
            if not final:
                tail = tail[:len(tail) - partial_suffix(tail, TOOL_CALL_START)]
            content.append(tail)
            break
        end = text.find(TOOL_CALL_END, start)
        if end < 0:
            content.append(text[position:] if final else text[position:start])
            break
        content.append(text[position:start])
        call = parse_block(text[start + len(TOOL_CALL_START):end], types)
        if call is None:
            content.append(text[start:end + len(TOOL_CALL_END)])
        else:
            calls.append(call)
        position = end + len(TOOL_CALL_END)
    joined = "".join(content)
    return ToolCallParse(joined.strip() if calls and strip else joined, calls)


class ToolCallDelta(NamedTuple):
    """What a stream step adds: content text and newly completed calls (with their index)."""

    content: str
    tool_calls: list[tuple[int, ParsedToolCall]]


class ToolCallStream:
    """Incremental parser over one choice's cumulative text."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None) -> None:
        self.tools = tools
        self.sent_content = ""
        self.num_calls = 0

    def update(self, text: str, final: bool) -> ToolCallDelta:
        """Deltas since the last call; `final` when the text is complete."""
        parsed = parse_tool_calls(text, self.tools, final=final, strip=False)
        delta, self.sent_content = stream_delta(self.sent_content, parsed.content)
        new_calls = list(enumerate(parsed.tool_calls))[self.num_calls:]
        self.num_calls = len(parsed.tool_calls)
        return ToolCallDelta(delta, new_calls)

"""Qwen3.5 tool-call markup (`<tool_call><function=NAME><parameter=K>V</parameter>...`, V raw text
for string parameters and JSON otherwise; or Hermes' JSON form) -> OpenAI `tool_calls`. A block
that does not close or parse stays content: parsing never raises. `ToolCallStream` parses a stream
incrementally and sends each call in pieces; `parse_forced_tool_calls` reads a forced output.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
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


FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"


class ToolCallPiece(NamedTuple):
    """A streamed piece of call number `call_index`: its first piece names the function (`name`;
    `arguments` "" for the XML form, all of them for a Hermes JSON block), the later ones carry
    argument text; the pieces' arguments joined are the call's JSON arguments."""

    call_index: int
    name: str | None
    arguments: str


class ToolCallDelta(NamedTuple):
    """What a stream step adds: content text and tool-call pieces (one per call at most)."""

    content: str
    tool_calls: list[ToolCallPiece]


class ToolCallStream:
    """Incremental tool-call parser over one choice's text, fed what is new each step (it reads only that
    and a short held-back tail); what it sends when is docs/serving.md's "Streamed calls" and "Forced calls".
    A repeated parameter name is sent twice (JSON readers keep the last, as `parse_tool_calls` does)."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None, forced: bool = False) -> None:
        self.tools = tools
        self.forced = forced
        self.types = parameter_types(tools)
        self.num_calls = 0       # calls announced so far
        self._state = "text"     # "text", "block" (before the function), "function", "parameter", "after", "raw"
        self._held = ""          # unread text: a partial marker, or the part being read
        self._name = ""          # the current call's function name
        self._params = 0         # parameters sent for the current call
        self._param = ""         # the parameter being read
        self._parts: list[str] = []  # a parameter's value or a raw block, in pieces
        self._tail = ""          # the last characters of `_parts`, where a closing marker may begin
        self._content: list[str] = []
        self._pieces: dict[int, ToolCallPiece] = {}  # this step's pieces, one per call

    def update(self, text: str, final: bool) -> ToolCallDelta:
        """Deltas for the new `text`; `final` when the output is complete."""
        self._held += text
        while self._step():
            pass
        if final:
            self._finish()
        content = "" if self.forced else "".join(self._content)
        pieces = list(self._pieces.values())
        self._content, self._pieces = [], {}
        return ToolCallDelta(content, pieces)

    def _step(self) -> bool:
        """Advance over `_held` once; False when it needs more text."""
        states: dict[str, Callable[[], bool]] = {
            "text": self._in_text, "block": self._in_block, "function": self._in_function,
            "parameter": self._in_parameter, "after": self._in_after, "raw": self._in_raw}
        return states[self._state]()

    def _in_text(self) -> bool:
        start = self._held.find(TOOL_CALL_START)
        if start < 0:
            keep = partial_suffix(self._held, TOOL_CALL_START)
            self._content.append(self._held[:len(self._held) - keep])
            self._held = self._held[len(self._held) - keep:]
            return False
        self._content.append(self._held[:start])
        self._held, self._state = self._held[start + len(TOOL_CALL_START):], "block"
        return True

    def _in_block(self) -> bool:
        body = self._held.lstrip()
        if body.startswith(FUNCTION_START):
            close = body.find(">")
            if close < 0 or "\n" in body[:close]:
                return self._raw() if close >= 0 or "\n" in body else False
            self._name, self._params = body[len(FUNCTION_START):close].strip(), 0
            self._held, self._state = body[close + 1:], "function"
            self._piece(self.num_calls, self._name, "")
            self.num_calls += 1
            return True
        if not body or FUNCTION_START.startswith(body):
            return False
        return self._raw()

    def _raw(self) -> bool:
        """Read the block whole (Hermes JSON, or malformed markup) until `</tool_call>`."""
        self._state, self._parts, self._tail = "raw", [], ""
        return True

    def _in_function(self) -> bool:
        body = self._held.lstrip()
        if body.startswith(PARAMETER_START):
            close = body.find(">")
            if close < 0:
                return False
            self._param = body[len(PARAMETER_START):close].strip()
            self._held, self._state, self._parts, self._tail = body[close + 1:], "parameter", [], ""
            return True
        if body.startswith(FUNCTION_END):
            self._held, self._state = body[len(FUNCTION_END):], "after"
            return True
        if body.startswith(TOOL_CALL_END):  # a call without </function>
            self._held, self._state = body, "after"
            return True
        return self._wait_or_drop(body, PARAMETER_START, FUNCTION_END, TOOL_CALL_END)

    def _in_parameter(self) -> bool:
        value = self._read_until(PARAMETER_END)
        if value is None:
            return False
        value = value.removeprefix("\n").removesuffix("\n")
        self._send_parameter(self._param, _convert_value(value, self.types.get(self._name, {}).get(self._param)))
        self._state = "function"
        return True

    def _in_after(self) -> bool:
        body = self._held.lstrip()
        if body.startswith(TOOL_CALL_END):
            self._close_call()
            self._held, self._state = body[len(TOOL_CALL_END):], "text"
            return True
        return self._wait_or_drop(body, TOOL_CALL_END)

    def _in_raw(self) -> bool:
        body = self._read_until(TOOL_CALL_END)
        if body is None:
            return False
        call = parse_block(body, self.types)
        if call is None:
            self._content.append(TOOL_CALL_START + body + TOOL_CALL_END)
        else:
            self._piece(self.num_calls, call.name, call.arguments)
            self.num_calls += 1
        self._state = "text"
        return True

    def _wait_or_drop(self, body: str, *markers: str) -> bool:
        """Hold `body` while it may still become one of `markers`; else drop the stray text before its next tag."""
        if not body or any(marker.startswith(body) for marker in markers):
            self._held = body
            return False
        stray = body.find("<", 1)
        self._held = body[stray:] if stray > 0 else ""
        return stray > 0

    def _read_until(self, marker: str) -> str | None:
        """Everything read in this state up to `marker` once it has come, with `_held` then the
        text after it; None before (the text is kept in pieces, and only the new text and the
        last characters before it, where the marker may have begun, are searched)."""
        new, self._held = self._held, ""
        window = self._tail + new
        found = window.find(marker)
        if found < 0:
            self._parts.append(new)
            self._tail = window[-(len(marker) - 1):]
            return None
        cut = found - len(self._tail)  # where the marker starts in `new` (negative: in earlier text)
        whole = "".join(self._parts) + new
        before = whole[:len(whole) - len(new) + cut]
        self._held, self._parts, self._tail = new[cut + len(marker):], [], ""
        return before

    def _piece(self, index: int, name: str | None, arguments: str) -> None:
        earlier = self._pieces.get(index)
        self._pieces[index] = ToolCallPiece(index, name, arguments) if earlier is None else \
            earlier._replace(arguments=earlier.arguments + arguments)

    def _send_parameter(self, key: str, value: Any) -> None:
        separator = "{" if self._params == 0 else ", "
        self._params += 1
        self._piece(self.num_calls - 1, None,
                    f"{separator}{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")

    def _close_call(self) -> None:
        self._piece(self.num_calls - 1, None, "}" if self._params else "{}")

    def _finish(self) -> None:
        """The output ended: flush or close whatever is open."""
        state, held = self._state, self._held
        self._held, self._state = "", "text"
        if state == "text":
            self._content.append(held)
        elif state in ("function", "parameter", "after"):
            self._close_call()  # cut short: the parameters it completed
        elif state == "block":
            self._content.append(TOOL_CALL_START + held)
        elif state == "raw":
            self._content.append(TOOL_CALL_START + "".join(self._parts) + held)
        self._parts, self._tail = [], ""


def parse_forced_tool_calls(text: str, tools: Sequence[Mapping[str, Any]] | None) -> list[ParsedToolCall]:
    """The calls of a forced output (`tool_choice` "required" or named), read as a stream reads
    them: no content, a call cut short closed with the parameters it completed."""
    delta = ToolCallStream(tools, forced=True).update(text, final=True)
    # one update: one piece per call, in call order, each naming its function
    return [ParsedToolCall(piece.name, piece.arguments) for piece in delta.tool_calls if piece.name is not None]

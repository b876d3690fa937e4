"""Grammars (llguidance's Lark dialect) that force tool calls in the Qwen3.5 markup `tool_parser`
reads: parameters in declared order, required ones present; strings raw text without `<` or
newlines, capped (so a weak model finishes them); other types schema-constrained JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from hybridserve.server.tool_parser import TOOL_CALL_END, TOOL_CALL_START

DEFAULT_STRING_CHARS = 64
MAX_PARALLEL_CALLS = 4  # a forced grammar with parallel calls admits at most this many, then ends


_literal = json.dumps  # a Lark string literal is spelled as a JSON string


def _value_rule(schema: Mapping[str, Any]) -> str:
    """The Lark body of one parameter value."""
    if isinstance(schema.get("enum"), list) and schema["enum"] and all(isinstance(v, str) for v in schema["enum"]):
        return " | ".join(_literal(v) for v in schema["enum"])
    if schema.get("type") == "string":
        shortest = max(1, int(schema.get("minLength", 1)))
        longest = max(shortest, int(schema.get("maxLength", DEFAULT_STRING_CHARS)))
        return f"/[^<\\n]{{{shortest},{longest}}}/"
    return "%json " + json.dumps(dict(schema) or {}, sort_keys=True)


def _function_rules(index: int, function: Mapping[str, Any], marker_tokens: bool) -> tuple[str, list[str]]:
    """(rule name, rule lines) for calls of one function."""
    name = function["name"]
    parameters = function.get("parameters") or {}
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or [])
    lines: list[str] = []
    parts: list[str] = []
    for number, (key, schema) in enumerate(properties.items()):
        value_rule = f"v{index}_{number}"
        param_rule = f"p{index}_{number}"
        lines.append(f"{value_rule}: {_value_rule(schema if isinstance(schema, Mapping) else {})}")
        lines.append(f"{param_rule}: {_literal(f'<parameter={key}>' + chr(10))} {value_rule} "
                     f"{_literal(chr(10) + '</parameter>' + chr(10))}")
        parts.append(param_rule if key in required else f"{param_rule}?")
    rule = f"call{index}"
    if marker_tokens:
        head = f"{TOOL_CALL_START} {_literal(f'{chr(10)}<function={name}>{chr(10)}')}"
        tail = f"{_literal(f'</function>{chr(10)}')} {TOOL_CALL_END}"
    else:
        head = _literal(f"{TOOL_CALL_START}\n<function={name}>\n")
        tail = _literal(f"</function>\n{TOOL_CALL_END}")
    lines.append(f"{rule}: {head} {' '.join(parts)} {tail}")
    return rule, lines


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], *, only: str | None = None,
                      multiple: bool = False, marker_tokens: bool = False) -> str:
    """A Lark grammar forcing calls of `tools` (of the function named `only`, if given).
    `multiple` allows up to `MAX_PARALLEL_CALLS` calls in a row; `marker_tokens` names the
    `<tool_call>`/`</tool_call>` added tokens instead of spelling them (llguidance treats those as special)."""
    functions = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    if not functions:
        raise ValueError(f"no tool named {only!r}" if only else "no tools to call")
    lines: list[str] = []
    names: list[str] = []
    for index, function in enumerate(functions):
        rule, rule_lines = _function_rules(index, function, marker_tokens)
        names.append(rule)
        lines.extend(rule_lines)
    lines.insert(0, f"call: {' | '.join(names)}")
    calls = "call"
    for _ in range(MAX_PARALLEL_CALLS - 1 if multiple else 0):
        calls = f'call ("\\n" {calls})?'
    lines.insert(0, f"start: {calls}")
    return "\n".join(lines) + "\n"

"""`--reasoning-parser qwen3`: text before `</think>` is reasoning, after it content (Qwen3.5
templates open `<think>` in the prompt, so the output often holds only the closing tag); without
one, the output is all reasoning when the prompt left a block open, else all content."""

from __future__ import annotations

from typing import NamedTuple

from hybridserve.server.tool_parser import partial_suffix, stream_delta

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_PARSERS = ("qwen3",)


class ReasoningSplit(NamedTuple):
    """An output split into its reasoning and its content."""

    reasoning: str
    content: str


def prompt_opens_thinking(prompt: str) -> bool:
    """True when the prompt ends inside an open `<think>` block."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


def split_reasoning(text: str, thinking_open: bool, *, final: bool = True) -> ReasoningSplit:
    """Split one output. With `final=False` a trailing partial `</think>` is held back."""
    body = text
    opened = thinking_open
    stripped = body.lstrip()
    if stripped.startswith(THINK_START):
        body, opened = stripped[len(THINK_START):], True
    end = body.find(THINK_END)
    if end >= 0:
        return ReasoningSplit(body[:end].strip("\n"), body[end + len(THINK_END):].lstrip("\n"))
    if not opened:
        return ReasoningSplit("", text)
    if not final:
        body = body[:len(body) - partial_suffix(body, THINK_END)]
    return ReasoningSplit(body.lstrip("\n"), "")


class ReasoningStream:
    """Incremental splitter over one choice's cumulative text."""

    def __init__(self, thinking_open: bool) -> None:
        self.thinking_open = thinking_open
        self.sent_reasoning = ""

    def update(self, text: str, final: bool) -> ReasoningSplit:
        """(new reasoning delta, cumulative content so far)."""
        split = split_reasoning(text, self.thinking_open, final=final)
        reasoning = split.reasoning.rstrip("\n")  # newlines before </think> may not belong to the reasoning
        delta, self.sent_reasoning = stream_delta(self.sent_reasoning, reasoning)
        return ReasoningSplit(delta, split.content)

"""`--reasoning-parser qwen3`: text before `</think>` is reasoning, after it content (Qwen3.5
templates open `<think>` in the prompt, so the output often holds only the closing tag); without
one, the output is all reasoning when the prompt left a block open, else all content."""

from __future__ import annotations

from typing import NamedTuple

from hybridserve.server.tool_parser import partial_suffix

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
    """Incremental splitter over one choice's text, fed what is new each step: the work per step is
    the new text plus a short held-back tail (a partial `</think>`, newlines that may end the
    reasoning). It agrees with `split_reasoning` except for an output that closes `</think>`
    without having opened one (neither in the prompt nor at its start): a stream sends it as content."""

    def __init__(self, thinking_open: bool) -> None:
        self.thinking_open = thinking_open
        self._phase = "start"  # "start": undecided; "reasoning"; "content"
        self._held = ""        # text not sent yet
        self._strip_lead = True  # newlines still to be dropped at the start of the current part

    def update(self, text: str, final: bool) -> ReasoningSplit:
        """(reasoning delta, content delta) for the new `text`; `final` when the output is complete."""
        held = self._held + text
        self._held = ""
        if self._phase == "start":
            stripped = held.lstrip()
            if not final and (not stripped or THINK_START.startswith(stripped)):
                self._held = held  # could still become an opening <think>
                return ReasoningSplit("", "")
            if stripped.startswith(THINK_START):
                self._phase, held = "reasoning", stripped[len(THINK_START):]
            else:
                self._phase = "reasoning" if self.thinking_open else "content"
                self._strip_lead = self.thinking_open
        if self._phase == "content":
            return ReasoningSplit("", self._lead(held))
        return self._reasoning(held, final)

    def _lead(self, text: str) -> str:
        """`text` without the newlines that open the current part (reasoning or content)."""
        if self._strip_lead:
            text = text.lstrip("\n")
            self._strip_lead = not text
        return text

    def _reasoning(self, held: str, final: bool) -> ReasoningSplit:
        held = self._lead(held)
        end = held.find(THINK_END)
        if end >= 0:
            self._phase, self._strip_lead = "content", True
            return ReasoningSplit(held[:end].rstrip("\n"), self._lead(held[end + len(THINK_END):]))
        keep = 0 if final else partial_suffix(held, THINK_END)
        sendable = held[:len(held) - keep].rstrip("\n")  # newlines before </think> are not reasoning
        self._held = "" if final else held[len(sendable):]
        return ReasoningSplit(sendable, "")

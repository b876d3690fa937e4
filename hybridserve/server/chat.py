"""Chat prompt rendering: the tokenizer's Jinja chat template in an immutable sandbox, with the
helpers Hugging Face templates expect, or a built-in ChatML one when it does not compile. A render
error (the template's own `raise_exception` included) is `ChatTemplateError`, a 400."""

from __future__ import annotations

import logging
from typing import Any

import jinja2

from hybridserve.models.tokenizer import chat_template_environment

logger = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template could not render these messages."""


class ChatRenderer:
    """Renders OpenAI-style message lists into a prompt string."""

    def __init__(self, template: str | None) -> None:
        env = chat_template_environment()
        self._template = env.from_string(CHATML_TEMPLATE)
        if template:
            try:
                self._template = env.from_string(template)
            except jinja2.TemplateError as exc:
                logger.warning("model chat template does not compile (%s); using built-in ChatML", exc)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               extra: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None) -> str:
        """Render `messages` (and `tools`, OpenAI function specs); `extra` (chat_template_kwargs,
        e.g. `enable_thinking`) cannot override the messages or tools."""
        context = dict(extra or {})
        context.update(messages=messages, add_generation_prompt=add_generation_prompt)
        if tools:
            context["tools"] = tools
        context.setdefault("tools", None)
        try:
            return self._template.render(**context)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template error: {exc}") from exc

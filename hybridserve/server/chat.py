"""Chat prompt rendering: the tokenizer's Jinja chat template in an immutable sandbox, with the
helpers Hugging Face templates expect, or a built-in ChatML one when it does not compile. A render
error (the template's own `raise_exception` included) is `ChatTemplateError`, a 400."""

from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template could not render these messages."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, autoescape=False)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


class ChatRenderer:
    """Renders OpenAI-style message lists into a prompt string."""

    def __init__(self, template: str | None) -> None:
        env = _environment()
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

"""Pydantic models of the OpenAI-compatible HTTP protocol (requests strict, responses plain).

Requests use `extra="forbid"` and strict types, so unknown fields and wrongly typed values are
rejected with a 400 that names the field. A few fields that the official clients may send are
accepted when they are harmless (`user`, `suffix=None`, `best_of == n`, empty `logit_bias`,
`response_format={"type": "text"}`); vLLM-style sampling extras map onto `SamplingParams`.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hybridserve.sampling_params import SamplingParams

MAX_N = 16
MAX_LOGPROBS = 20


class StrictModel(BaseModel):
    """Base of all request models: unknown fields and type coercions are errors."""

    model_config = ConfigDict(extra="forbid", strict=True)


# --------------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    """Body of the OpenAI error envelope."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """`{"error": {...}}`, the OpenAI error envelope."""

    error: ErrorInfo


# --------------------------------------------------------------------------- requests
class StreamOptions(StrictModel):
    """`stream_options`: `include_usage` adds a final chunk with usage and no choices."""

    include_usage: bool = False


class ResponseFormat(StrictModel):
    """Only plain text responses are supported."""

    type: Literal["text"]


class _SamplingRequest(StrictModel):
    """Fields shared by completion and chat-completion requests."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1 - MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1)
    logit_bias: dict[str, float] | None = None

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, value: int | None) -> int | None:
        if value is not None and value != -1 and value < 1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else (value or [])
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("logit_bias is not supported")
        return value

    @model_validator(mode="after")
    def _check_stream_options(self) -> "_SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None, index: int) -> SamplingParams:
        """`SamplingParams` for choice `index` (seeded requests use seed + index)."""
        values: dict[str, Any] = {
            "max_tokens": max_tokens, "logprobs": logprobs, "ignore_eos": self.ignore_eos,
            "min_tokens": min(self.min_tokens, max_tokens),
            "stop": self.stop, "stop_token_ids": self.stop_token_ids,
            "seed": None if self.seed is None else self.seed + index,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        return SamplingParams(**values)


class CompletionRequest(_SamplingRequest):
    """`POST /v1/completions`."""

    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: str | list[str] | list[int]) -> str | list[str] | list[int]:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and isinstance(value[0], str) and len(value) != 1:
            raise ValueError("a list prompt must hold exactly one string (batched prompts are not supported)")
        if isinstance(value, list) and isinstance(value[0], int) and min(value) < 0:
            raise ValueError("prompt token ids must be non-negative")
        return value

    @model_validator(mode="after")
    def _check_best_of(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must be omitted or equal n)")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo together with logprobs is not supported (no prompt logprobs)")
        return self

    @property
    def prompt_input(self) -> str | list[int]:
        """The single prompt, as text or token ids."""
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt  # type: ignore[return-value]


class TextContentPart(StrictModel):
    """A `{"type": "text", "text": ...}` message content part (the only kind supported)."""

    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    """One chat message; content is a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _check_content(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for role {self.role!r}")
        return self

    def to_template_dict(self) -> dict[str, Any]:
        """Plain dict for the chat template (text parts joined into one string)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingRequest):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens`, else the legacy `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Top-k alternatives to return per token, or None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None


# --------------------------------------------------------------------------- responses
def now() -> int:
    """Unix time for `created` fields."""
    return int(time.time())


class PromptTokensDetails(BaseModel):
    """`usage.prompt_tokens_details`: prompt tokens restored from the prefix cache."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token accounting of a response."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs layout."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One completion choice (also used for stream chunks, with the text delta)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(BaseModel):
    """Non-streamed completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    """One alternative token in chat logprobs."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """A generated token with its alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    """`choices[i].logprobs` of a chat response."""

    content: list[ChatTokenLogprob] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    """The generated message."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    """One chat completion choice."""

    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    """Non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """Incremental message content of a chat stream chunk."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    """One choice of a chat stream chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """An entry of `GET /v1/models`."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "hybridserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    """`GET /v1/models`."""

    object: Literal["list"] = "list"
    data: list[ModelCard]

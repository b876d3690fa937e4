"""Pydantic models of the OpenAI-compatible HTTP protocol. Requests, as in vLLM, ignore unknown
fields (`ignored_fields` names them for the log) and validate known ones strictly: no coercion,
ranges checked. vLLM's extras (sampling knobs, `structured_outputs` / `guided_*`,
`chat_template_kwargs`) are accepted."""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from hybridserve.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams

MAX_N = 16


class LenientModel(BaseModel):
    """Base of all request models: unknown fields are kept aside (and ignored), known ones strict."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    def ignored_fields(self, prefix: str = "") -> list[str]:
        """Dotted names of the unknown fields here and in nested request models."""
        names = [prefix + key for key in (self.model_extra or {})]
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, LenientModel):
                names.extend(value.ignored_fields(f"{prefix}{name}."))
            elif isinstance(value, list) and value and isinstance(value[0], LenientModel):
                for index, item in enumerate(value):  # a list's members share a type: models or plain values
                    names.extend(item.ignored_fields(f"{prefix}{name}[{index}]."))
        return names


class ErrorInfo(BaseModel):
    """Body of the OpenAI error envelope."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """`{"error": {...}}`, the OpenAI error envelope."""

    error: ErrorInfo


class StreamOptions(LenientModel):
    """`stream_options`: `include_usage` adds a final chunk with usage and no choices."""

    include_usage: bool = False


class JsonSchemaFormat(LenientModel):
    """`response_format.json_schema`: a named JSON schema."""

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(LenientModel):
    """`response_format`: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("response_format json_schema needs json_schema.schema")
        return self


class StructuredOutputsRequest(LenientModel):
    """vLLM's `structured_outputs` request field (exactly one constraint)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingRequest(LenientModel):
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
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1)
    logit_bias: dict[str, float] | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

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
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return value

    @model_validator(mode="after")
    def _check_stream_options(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def structured_output_params(self) -> StructuredOutputsParams | None:
        """The output constraint from `structured_outputs` or the `guided_*` extras (at most one)."""
        given: list[StructuredOutputsParams] = []
        if self.structured_outputs is not None:
            so = self.structured_outputs
            given.append(StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice,
                                                 grammar=so.grammar, json_object=so.json_object))
        for name, field in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                            ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                given.append(StructuredOutputsParams(**{field: getattr(self, name)}))
        if len(given) > 1:
            raise ValueError("give at most one output constraint (structured_outputs, guided_*, response_format)")
        return given[0] if given else None

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        structured: StructuredOutputsParams | None) -> SamplingParams:
        """`SamplingParams` of this request's `n` completions (completion i uses seed + i)."""
        values: dict[str, Any] = {
            "n": self.n, "max_tokens": max_tokens, "logprobs": logprobs, "ignore_eos": self.ignore_eos,
            "min_tokens": min(self.min_tokens, max_tokens), "seed": self.seed,
            "stop": self.stop, "stop_token_ids": self.stop_token_ids, "structured_outputs": structured,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logit_bias": {int(k): v for k, v in (self.logit_bias or {}).items()} or None,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        return SamplingParams(**values)


class CompletionRequest(_SamplingRequest):
    """`POST /v1/completions`; `prompt` is one prompt (text or token ids) or a batch of them.
    `echo` with `logprobs` also scores the prompt (its tokens' logprobs come first, the first
    token's is null); `max_tokens: 0` with `echo` returns the prompt alone (as vLLM does)."""

    # Members are strict, so at most one matches; trying them in order stops there instead of
    # validating every member ("smart" mode), which long token-id prompts pay for.
    prompt: str | list[int] | list[str] | list[list[int]] = Field(union_mode="left_to_right")
    echo: bool = False  # before max_tokens: its validator reads it
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        items = value if isinstance(value, list) and value and not isinstance(value[0], int) else [value]
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        for item in items:
            if isinstance(item, list) and (not item or min(item) < 0):
                raise ValueError("token-id prompts must be non-empty lists of non-negative ids")
        return value

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must be omitted or equal n)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    @field_validator("max_tokens")
    @classmethod
    def _check_max_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens must be >= 1 (0 is allowed only with echo, to return the prompt alone)")
        return value

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt (and its logprobs) alone, no completion."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        structured: StructuredOutputsParams | None) -> SamplingParams:
        """As for any request; `echo` with `logprobs` asks for the prompt's logprobs too."""
        params = super().sampling_params(max_tokens, logprobs, structured)
        if self.echo and logprobs is not None:
            params.prompt_logprobs = logprobs
            params.validate()
        return params

    @property
    def prompt_inputs(self) -> list[str | list[int]]:
        """The prompts of this request, as text or token ids."""
        value = self.prompt
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]
        return list(value)  # type: ignore[arg-type]


class ContentPart(LenientModel):
    """A message content part; only `{"type": "text", "text": ...}` is supported."""

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _check_text(self) -> ContentPart:
        if self.type != "text" or self.text is None:
            raise ValueError(f"content part type {self.type!r} is not supported (text only)")
        return self


class FunctionCall(LenientModel):
    """A function call inside an assistant message's `tool_calls`."""

    name: str
    arguments: str


class ToolCallParam(LenientModel):
    """`tool_calls[i]` of an assistant message in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(LenientModel):
    """One chat message; content is a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _check_content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for role {self.role!r}")
        return self

    def to_template_dict(self) -> dict[str, Any]:
        """Plain dict for the chat template (text parts joined; call arguments parsed to dicts)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text or "" for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        for name in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        if self.tool_calls:
            message["tool_calls"] = [_template_tool_call(call) for call in self.tool_calls]
        return message


def _template_tool_call(call: ToolCallParam) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments) if call.function.arguments else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"tool call arguments are not valid JSON: {exc}") from None
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


class FunctionDefinition(LenientModel):
    """`tools[i].function`: a callable function and its JSON-schema parameters."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(LenientModel):
    """`tools[i]`."""

    type: Literal["function"]
    function: FunctionDefinition

    def template_dict(self) -> dict[str, Any]:
        """The tool as the chat template sees it (OpenAI's shape)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(LenientModel):
    """`tool_choice.function`."""

    name: str


class NamedToolChoice(LenientModel):
    """`tool_choice` naming one function to call."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_logprobs_and_tools(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice requires tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {tool.function.name for tool in self.tools or []}
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens`, else the legacy `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Top-k alternatives to return per token, or None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template and parsers, unless `tool_choice` is `none`."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.template_dict() for tool in self.tools]


class TokenizeRequest(LenientModel):
    """`POST /tokenize`: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _check_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(LenientModel):
    """`POST /detokenize`."""

    model: str | None = None
    tokens: list[int]


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
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One completion choice (also used for stream chunks, with the text delta)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionResponse(CompletionStreamResponse):
    """Non-streamed completion."""

    usage: UsageInfo


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


class FunctionCallOut(BaseModel):
    """A called function and its arguments (JSON text)."""

    name: str
    arguments: str


class ToolCallOut(BaseModel):
    """`message.tool_calls[i]` of a response."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    """The generated message: content, the reasoning (with a reasoning parser) and tool calls."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


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


class _WithoutNulls(BaseModel):
    """A model whose unset (None) fields are left out of its JSON, as OpenAI's stream pieces are:
    its clients merge pieces field by field, and a null `type` would overwrite "function"."""

    @model_serializer(mode="wrap")
    def _drop_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(_WithoutNulls):
    """Function part of a streamed tool call."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_WithoutNulls):
    """A tool call in a chat stream chunk (index identifies the call across chunks; the first
    piece of a call carries its id, type and name, the later ones argument text only)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    """Incremental message content of a chat stream chunk."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


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


class TokenizeResponse(BaseModel):
    """`POST /tokenize`."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    """`POST /detokenize`."""

    prompt: str


class VersionResponse(BaseModel):
    """`GET /version`."""

    version: str

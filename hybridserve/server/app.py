"""The OpenAI-compatible HTTP app: `build_app(engine, ...)` returns a ready FastAPI instance.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (JSON or SSE streaming),
`GET /v1/models`, `GET /v1/models/{id}`, `POST /tokenize`, `POST /detokenize`, `GET /version`,
`GET /health`, `GET /metrics`, and the OpenAPI schema at `GET /openapi.json` (interactive page
`GET /docs`). Every error, including unknown routes,
answers with the OpenAI envelope `{"error": {"message", "type", "param", "code"}}`.
Two pure-ASGI middlewares guard the app: bearer-key auth on `/v1/*` and a body-size cap.
A request whose client disconnects is aborted in the engine, streaming or not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.background import BackgroundTask
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hybridserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineOverloadedError,
    EngineStepError,
    RequestStream,
)
import hybridserve
from hybridserve.sampling_params import MAX_STREAM_INTERVAL, CompletionOutput, RequestOutput, RequestOutputKind, \
    SamplingParams, StructuredOutputsParams
from hybridserve.server.auth import ApiKeyring, TenantAuthMiddleware, request_tenant, tenant_cache_salt
from hybridserve.server.chat import ChatRenderer, ChatTemplateError
from hybridserve.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from hybridserve.server.metrics import RequestTracker, ServerMetrics
from hybridserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    FunctionCallOut,
    LenientModel,
    ModelCard,
    ModelList,
    NamedToolChoice,
    PromptTokensDetails,
    TokenizeRequest,
    TokenizeResponse,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
    VersionResponse,
    now,
)
from hybridserve.server.reasoning_parser import (
    REASONING_PARSERS,
    THINK_END,
    ReasoningStream,
    prompt_opens_thinking,
    split_reasoning,
)
from hybridserve.server.sse import EventStreamResponse, SendEvent, TextChunkTemplate, sse_event
from hybridserve.server.tool_grammar import tool_call_grammar
from hybridserve.server.tool_parser import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    ParsedToolCall,
    ToolCallStream,
    parse_tool_calls,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
RETRY_AFTER_SECONDS = 1
_MIN_LOGPROB = -9999.0
_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                   500: "server_error", 503: "service_unavailable_error"}


# =========================================================================== errors
class APIError(Exception):
    """An error to answer with the OpenAI envelope."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 error_type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPE_BY_STATUS.get(status, "invalid_request_error")
        self.headers = headers or {}

    def envelope(self) -> bytes:
        """JSON body of the error."""
        info = ErrorInfo(message=self.message, type=self.error_type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump_json().encode()

    def response(self) -> Response:
        """The HTTP response for this error."""
        return Response(self.envelope(), status_code=self.status, headers=self.headers,
                        media_type="application/json")

    async def send(self, send: Send) -> None:
        """Send as a raw ASGI response (for middlewares that sit outside FastAPI)."""
        headers = [(b"content-type", b"application/json")]
        headers += [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.envelope()})


def _overloaded(message: str) -> APIError:
    return APIError(503, message, code="server_overloaded", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def _engine_error(exc: Exception) -> APIError:
    """Map an `AsyncLLMEngine` exception onto an HTTP error."""
    if isinstance(exc, EngineOverloadedError):
        return _overloaded(str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    return APIError(500, f"internal error: {exc}", code="engine_error")


def _request_failed(output: RequestOutput) -> APIError:
    """The error event of a request the engine ended with finish_reason "error"."""
    return APIError(500, f"request {output.request_id} failed in the engine (non-finite logits, a sampler "
                    f"or a detokenizer error); other requests are unaffected", code="request_failed")


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": (), "type": ""}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"malformed JSON body: {detail}".strip(), code="invalid_json")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if not loc and first.get("type") == "missing":
        return APIError(400, "a JSON request body is required")
    if not loc and first.get("type") in ("model_attributes_type", "model_type", "dict_type"):
        return APIError(400, "the request body must be a JSON object (Content-Type: application/json)",
                        code="invalid_body")
    if not loc:
        return APIError(400, f"invalid request: {msg}", code="invalid_value")
    return APIError(400, f"invalid field {'.'.join(loc)}: {msg}", param=loc[0], code="invalid_value")


def _install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    async def on_validation(_: Request, exc: RequestValidationError) -> Response:
        return _validation_error(exc).response()

    async def on_http(_: Request, exc: StarletteHTTPException) -> Response:
        message = "route not found" if exc.status_code == 404 else str(exc.detail)
        return APIError(exc.status_code, message, headers=dict(exc.headers or {})).response()

    async def on_engine(_: Request, exc: Exception) -> Response:
        return _engine_error(exc).response()

    async def on_unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error", exc_info=exc)
        return APIError(500, "internal server error").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    for kind in (EngineOverloadedError, EngineDeadError, EngineStepError):
        app.add_exception_handler(kind, on_engine)
    app.add_exception_handler(Exception, on_unexpected)


# =========================================================================== middlewares
class BodyLimitMiddleware:
    """Reads the whole request body up front (at most `max_body_bytes`, else 413) and replays it."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check_declared_length(scope)
            body = await self._read_body(receive)
        except APIError as error:
            await error.send(send)
            return
        if body is None:  # client left while sending
            return
        await self.app(scope, _replay(body, receive), send)

    def _too_large(self) -> APIError:
        return APIError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes",
                        code="request_too_large")

    def _check_declared_length(self, scope: Scope) -> None:
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is None:
            return
        if not declared.isdigit():
            raise APIError(400, "invalid Content-Length header")
        if int(declared) > self.max_body_bytes:
            raise self._too_large()

    async def _read_body(self, receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that first yields the buffered body, then defers to the server (disconnects)."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


# =========================================================================== serving helpers
class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(work: Awaitable[Any], request: Request) -> Any:
    """Await `work`, cancelling it (and raising `ClientDisconnected`) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as `(choice index, output)` pairs."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((index, exc))
        queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def _finite(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


_TokenEntry = tuple[str, float, list[tuple[str, float]]]


@dataclasses.dataclass
class _ChatOptions:
    """How a chat job's output text becomes a message."""

    tools: list[dict[str, Any]] | None     # parse tool calls against these (None: no parsing)
    split_reasoning: bool                   # a reasoning parser is configured
    thinking_open: bool                     # the prompt ends inside an open <think> block


@dataclasses.dataclass
class _Job:
    """One HTTP request's engine work: one engine request (with `n` completions) per prompt."""

    request_id: str
    model: str
    prompts: list[list[int]]
    params: SamplingParams
    cache_salt: str | None
    num_logprobs: int | None
    include_usage: bool
    echo_texts: list[str]
    chat: _ChatOptions | None = None
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    created: int = dataclasses.field(default_factory=now)  # one `created` for every chunk, as OpenAI sends

    def engine_id(self, prompt_index: int) -> str:
        """Engine request id of prompt `prompt_index`."""
        return f"{self.request_id}-{prompt_index}"

    def choice_index(self, prompt_index: int, completion_index: int) -> int:
        """OpenAI choice index: prompt-major, then completion."""
        return prompt_index * self.params.n + completion_index


@dataclasses.dataclass
class _ChoiceState:
    """What has been streamed so far for one choice."""

    sent_text: str = ""
    sent_tokens: int = 0
    text_offset: int = 0
    started: bool = False
    holdback: int = 0
    done: bool = False
    reasoning: ReasoningStream | None = None
    tools: ToolCallStream | None = None
    sent_content: str = ""

    def visible_text(self, output: CompletionOutput) -> str:
        """The text that may be sent: while unfinished, the last `holdback` characters stay back
        (they may be the start of a stop string that the engine will cut)."""
        text = output.text
        if output.finish_reason is None and self.holdback:
            text = text[:max(len(self.sent_text), len(text) - self.holdback)]
        return text

    def text_delta(self, output: CompletionOutput) -> str:
        """New text since the last chunk."""
        text = self.visible_text(output)
        if not text.startswith(self.sent_text):
            return ""
        delta = text[len(self.sent_text):]
        self.sent_text = text
        return delta


class _MessageParts(NamedTuple):
    """A chat completion's text split into content, reasoning and tool calls."""

    content: str
    reasoning: str | None
    tool_calls: list[ParsedToolCall]


# =========================================================================== serving
class OpenAIServing:
    """Turns protocol requests into engine requests and engine outputs into responses."""

    def __init__(self, engine: AsyncLLMEngine, model_names: str | Sequence[str],
                 reasoning_parser: str | None = None, stream_interval: int = 1) -> None:
        if not isinstance(stream_interval, int) or not 1 <= stream_interval <= MAX_STREAM_INTERVAL:
            raise ValueError(f"stream_interval must be an integer in [1, {MAX_STREAM_INTERVAL}], "
                             f"got {stream_interval!r}")
        self.engine = engine
        self.stream_interval = stream_interval
        self.model_names = [model_names] if isinstance(model_names, str) else list(model_names)
        if not self.model_names:
            raise ValueError("at least one served model name is needed")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r} (known: {', '.join(REASONING_PARSERS)})")
        self.model_name = self.model_names[0]
        self.reasoning_parser = reasoning_parser
        self.tokenizer = engine.tokenizer
        self.metrics = ServerMetrics()
        self.chat = ChatRenderer(getattr(engine.tokenizer, "chat_template", None))
        model_config = getattr(engine, "model_config", None)
        self.vocab_size: int | None = getattr(model_config, "vocab_size", None)

    # ------------------------------------------------------------- entry points
    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        """`POST /v1/completions` (one prompt or a batch of them)."""
        model = self._check_model(body.model)
        self._log_ignored("completion", body)
        prompts = [await self._encode(p) if isinstance(p, str) else list(p) for p in body.prompt_inputs]
        max_tokens = min(self._max_tokens(len(ids), body.max_tokens, "max_tokens" in body.model_fields_set,
                                          default=16, param="prompt") for ids in prompts)
        echo = [""] * len(prompts)
        if body.echo:
            echo = [p if isinstance(p, str) else self.tokenizer.decode(ids)
                    for p, ids in zip(body.prompt_inputs, prompts)]
        structured = self._constraint(body.structured_output_params)
        job = self._job("cmpl", model, body, prompts, max_tokens, body.logprobs, echo, structured)
        job.cache_salt = tenant_cache_salt(request_tenant(request.scope), job.cache_salt)
        streams = await self._submit(job)
        if body.stream:
            return self._event_stream(self._stream_completion(job, streams), streams)
        finals = await self._collect(job, streams, request)
        return _json(self._completion_response(job, finals))

    async def chat_completion(self, body: ChatCompletionRequest, request: Request) -> Response:
        """`POST /v1/chat/completions`."""
        model = self._check_model(body.model)
        self._log_ignored("chat completion", body)
        structured = self._constraint(lambda: self._chat_constraint(body))
        text = self._render_chat(body.messages, body.tool_dicts, body.chat_template_kwargs,
                                 body.add_generation_prompt)
        if structured is not None and prompt_opens_thinking(text):
            text += f"{THINK_END}\n\n"  # a grammar constrains the answer: close the thinking block first
        prompt_ids = await self._encode(text)
        max_tokens = self._max_tokens(len(prompt_ids), body.requested_max_tokens,
                                      body.requested_max_tokens is not None, default=None, param="messages")
        options = _ChatOptions(tools=body.tool_dicts, split_reasoning=self.reasoning_parser is not None,
                               thinking_open=prompt_opens_thinking(text))
        job = self._job("chatcmpl", model, body, [prompt_ids], max_tokens, body.num_logprobs, [""], structured)
        job.chat = options
        job.cache_salt = tenant_cache_salt(request_tenant(request.scope), job.cache_salt)
        streams = await self._submit(job)
        if body.stream:
            return self._event_stream(self._stream_chat(job, streams), streams)
        finals = await self._collect(job, streams, request)
        return _json(self._chat_response(job, finals[0]))

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        """`POST /tokenize`: token ids of a prompt, or of chat messages rendered by the template."""
        self._check_model(body.model)
        if body.messages is not None:
            tools = [tool.template_dict() for tool in body.tools] if body.tools else None
            text = self._render_chat(body.messages, tools, body.chat_template_kwargs, body.add_generation_prompt)
        else:
            text = body.prompt or ""
        ids = list(await asyncio.to_thread(self.tokenizer.encode, text)) if text else []
        strs = [self._token_text(t) for t in ids] if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """`POST /detokenize`: the text of token ids."""
        self._check_model(body.model)
        bad = [t for t in body.tokens if t < 0 or (self.vocab_size is not None and t >= self.vocab_size)]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary", param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(body.tokens))

    async def render_metrics(self) -> bytes:
        """Prometheus text with fresh engine stats."""
        try:
            stats = await self.engine.stats()
        except EngineDeadError:
            stats = {}
        return self.metrics.render(stats)

    def models(self) -> ModelList:
        """`GET /v1/models`: every served name (aliases of the one model)."""
        return ModelList(data=[self.model_card(name) for name in self.model_names])

    def model_card(self, name: str) -> ModelCard:
        """`GET /v1/models/{name}`."""
        self._check_model(name)
        return ModelCard(id=name, max_model_len=self.engine.max_model_len)

    # ------------------------------------------------------------- request preparation
    def _check_model(self, model: str | None) -> str:
        """The served name a request uses (404 for an unknown one)."""
        if model is None:
            return self.model_name
        if model not in self.model_names:
            raise APIError(404, f"the model `{model}` does not exist (serving {', '.join(self.model_names)})",
                           param="model", code="model_not_found")
        return model

    @staticmethod
    def _log_ignored(kind: str, body: LenientModel) -> None:
        ignored = body.ignored_fields()
        if ignored:
            logger.warning("%s request: ignored unknown field(s): %s", kind, ", ".join(sorted(ignored)))

    def _render_chat(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None,
                     kwargs: dict[str, Any] | None, add_generation_prompt: bool) -> str:
        try:
            return self.chat.render([m.to_template_dict() for m in messages],
                                    add_generation_prompt=add_generation_prompt, extra=kwargs, tools=tools)
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages", code="chat_template_error") from exc
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from exc

    @staticmethod
    def _constraint(build: Callable[[], StructuredOutputsParams | None]) -> StructuredOutputsParams | None:
        try:
            return build()
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_structured_output") from exc

    def _chat_constraint(self, body: ChatCompletionRequest) -> StructuredOutputsParams | None:
        """The grammar of a chat request: forced tool calls, `response_format`, or vLLM's extras."""
        given = []
        extra = body.structured_output_params()
        if extra is not None:
            given.append(extra)
        response_format = body.response_format
        if response_format is not None and response_format.type == "json_object":
            given.append(StructuredOutputsParams(json_object=True))
        elif response_format is not None and response_format.type == "json_schema":
            assert response_format.json_schema is not None
            given.append(StructuredOutputsParams(json=response_format.json_schema.json_schema))
        tools = body.tool_dicts
        if tools and (body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice)):
            only = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
            multiple = body.tool_choice == "required" and body.parallel_tool_calls is not False
            marker_tokens = all(self.tokenizer.token_to_id(m) is not None for m in (TOOL_CALL_START, TOOL_CALL_END))
            grammar = tool_call_grammar(tools, only=only, multiple=multiple, marker_tokens=marker_tokens)
            given.append(StructuredOutputsParams(grammar=grammar))
        if len(given) > 1:
            raise ValueError("give at most one output constraint (response_format, forced tool_choice, "
                             "structured_outputs or guided_*)")
        return given[0] if given else None

    async def _encode(self, text: str) -> list[int]:
        if not text:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return list(await asyncio.to_thread(self.tokenizer.encode, text))

    def _max_tokens(self, prompt_len: int, requested: int | None, explicit: bool,
                    default: int | None, param: str) -> int:
        limit = self.engine.max_model_len
        if prompt_len == 0:
            raise APIError(400, "prompt must not be empty", param=param)
        if prompt_len >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; the prompt has "
                           f"{prompt_len} tokens, leaving no room for a completion.",
                           param=param, code="context_length_exceeded")
        room = limit - prompt_len
        if not explicit or requested is None:
            room = max(1, min(room, self.engine.max_request_tokens - prompt_len))
        if explicit and requested is not None and requested > room:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; {prompt_len + requested} "
                           f"were requested ({prompt_len} in the prompt, {requested} for the completion).",
                           param="max_tokens", code="context_length_exceeded")
        wanted = requested if requested is not None else default
        return room if wanted is None else min(wanted, room)

    def _job(self, prefix: str, model: str, body: CompletionRequest | ChatCompletionRequest,
             prompts: list[list[int]], max_tokens: int, num_logprobs: int | None, echo_texts: list[str],
             structured: StructuredOutputsParams | None) -> _Job:
        try:
            params = body.sampling_params(max_tokens, num_logprobs, structured)
            if not body.stream:  # the response is built from the final output alone
                params.output_kind = RequestOutputKind.FINAL_ONLY
            else:
                params.stream_interval = self.stream_interval
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        if self.vocab_size is not None and params.top_k > self.vocab_size:
            params.top_k = -1
        if self.vocab_size is not None and any(t >= self.vocab_size for t in params.logit_bias or {}):
            raise APIError(400, f"logit_bias names a token id outside the vocabulary [0, {self.vocab_size})",
                           param="logit_bias")
        return _Job(f"{prefix}-{uuid.uuid4().hex}", model, prompts, params, body.cache_salt,
                    num_logprobs, body.include_usage, echo_texts)

    async def _submit(self, job: _Job) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for index, prompt_ids in enumerate(job.prompts):
                streams.append(await self.engine.add_request(job.engine_id(index), prompt_ids,
                                                             job.params, job.cache_salt))
        except BaseException as exc:
            for stream in streams:
                self.engine.abort(stream.request_id)
            if isinstance(exc, Exception):
                raise _engine_error(exc) from exc
            raise
        return streams

    # ------------------------------------------------------------- collection
    async def _collect(self, job: _Job, streams: list[RequestStream], request: Request) -> list[RequestOutput]:
        trackers = [self.metrics.tracker(job.arrival) for _ in streams]

        async def final(stream: RequestStream, tracker: RequestTracker) -> RequestOutput:
            last: RequestOutput | None = None
            async for output in stream:
                tracker.observe(output)
                last = output
            assert last is not None
            return last

        try:
            return await _unless_disconnected(
                asyncio.gather(*(final(s, t) for s, t in zip(streams, trackers))), request)
        except ClientDisconnected:
            raise APIError(499, "client disconnected", code="client_closed_request") from None
        except (EngineStepError, EngineDeadError) as exc:
            raise _engine_error(exc) from exc
        finally:
            self._abort_unfinished(streams)

    def _abort_unfinished(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)

    async def _abort_after_stream(self, streams: list[RequestStream]) -> None:
        """A streamed response's background task. Aborting never blocks, and as a coroutine it
        runs on the event loop; Starlette would hand a plain function to a worker thread."""
        self._abort_unfinished(streams)

    def _usage(self, job: _Job, finals: list[RequestOutput | None]) -> UsageInfo:
        completion = sum(len(o.token_ids) for f in finals if f is not None for o in f.outputs)
        cached = sum(f.num_cached_tokens for f in finals if f is not None)
        prompt = sum(len(ids) for ids in job.prompts)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    # ------------------------------------------------------------- logprobs
    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _token_entries(self, output: CompletionOutput, start: int, k: int) -> list[_TokenEntry]:
        """(token text, its logprob, top-k alternatives) for generated tokens from `start` on."""
        entries = []
        table = output.logprobs or []
        for i in range(start, len(output.token_ids)):
            token_id = output.token_ids[i]
            row = table[i] if i < len(table) else {}
            top = sorted(row.items(), key=lambda item: -item[1])[:k]
            entries.append((self._token_text(token_id), _finite(row.get(token_id, _MIN_LOGPROB)),
                            [(self._token_text(t), _finite(v)) for t, v in top]))
        return entries

    def _completion_logprobs(self, output: CompletionOutput, start: int, k: int, offset: int) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for text, logprob, top in self._token_entries(output, start, k):
            result.tokens.append(text)
            result.token_logprobs.append(logprob)
            result.top_logprobs.append(dict(top))
            result.text_offset.append(offset)
            offset += len(text)
        return result

    def _chat_logprobs(self, output: CompletionOutput, start: int, k: int) -> ChatChoiceLogprobs:
        content = [
            ChatTokenLogprob(token=text, logprob=logprob, bytes=list(text.encode()),
                             top_logprobs=[TopLogprob(token=t, logprob=v, bytes=list(t.encode())) for t, v in top])
            for text, logprob, top in self._token_entries(output, start, k)
        ]
        return ChatChoiceLogprobs(content=content)

    # ------------------------------------------------------------- chat message parts
    def _message_parts(self, options: _ChatOptions, text: str) -> _MessageParts:
        """Split a finished completion into content, reasoning and tool calls (never raises)."""
        content, reasoning = text, None
        if options.split_reasoning:
            split = split_reasoning(text, options.thinking_open)
            content, reasoning = split.content, split.reasoning
        calls: list[ParsedToolCall] = []
        if options.tools:
            parsed = parse_tool_calls(content, options.tools)
            content, calls = parsed.content, parsed.tool_calls
        return _MessageParts(content, reasoning, calls)

    @staticmethod
    def _tool_call_id(job: _Job, choice: int, call: int) -> str:
        return f"call_{job.request_id.rsplit('-', 1)[-1][:16]}_{choice}_{call}"

    @staticmethod
    def _chat_finish_reason(reason: str | None, has_calls: bool) -> str | None:
        return "tool_calls" if has_calls and reason == "stop" else reason

    # ------------------------------------------------------------- non-streamed responses
    def _completion_response(self, job: _Job, finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for prompt_index, final in enumerate(finals):
            echo = job.echo_texts[prompt_index]
            for out in final.outputs:
                logprobs = None
                if job.num_logprobs is not None:
                    logprobs = self._completion_logprobs(out, 0, job.num_logprobs, len(echo))
                choices.append(CompletionChoice(index=job.choice_index(prompt_index, out.index), text=echo + out.text,
                                                logprobs=logprobs, finish_reason=out.finish_reason,
                                                stop_reason=out.stop_reason))
        return CompletionResponse(id=job.request_id, model=job.model, choices=choices,
                                  usage=self._usage(job, list(finals)))

    def _chat_response(self, job: _Job, final: RequestOutput) -> ChatCompletionResponse:
        assert job.chat is not None
        choices = []
        for out in final.outputs:
            logprobs = None if job.num_logprobs is None else self._chat_logprobs(out, 0, job.num_logprobs)
            parts = self._message_parts(job.chat, out.text)
            calls = [ToolCallOut(id=self._tool_call_id(job, out.index, i),
                                 function=FunctionCallOut(name=c.name, arguments=c.arguments))
                     for i, c in enumerate(parts.tool_calls)]
            message = AssistantMessage(content=parts.content if parts.content or not calls else None,
                                       reasoning_content=parts.reasoning, tool_calls=calls)
            choices.append(ChatChoice(index=out.index, message=message, logprobs=logprobs,
                                      finish_reason=self._chat_finish_reason(out.finish_reason, bool(calls)),
                                      stop_reason=out.stop_reason))
        return ChatCompletionResponse(id=job.request_id, model=job.model, choices=choices,
                                      usage=self._usage(job, [final]))

    # ------------------------------------------------------------- streamed responses
    def _event_stream(self, write_events: Callable[[SendEvent], Awaitable[None]],
                      streams: list[RequestStream]) -> EventStreamResponse:
        # The background task also covers a client gone before the events ever started.
        return EventStreamResponse(write_events, background=BackgroundTask(self._abort_after_stream, streams))

    async def _write_events(self, job: _Job, streams: list[RequestStream],
                            chunk: Callable[[int, _ChoiceState, CompletionOutput], BaseModel | str | None],
                            usage_chunk: Callable[[UsageInfo], BaseModel],
                            new_state: Callable[[], _ChoiceState], send_event: SendEvent) -> None:
        states: dict[int, _ChoiceState] = {}
        trackers = [self.metrics.tracker(job.arrival) for _ in streams]
        lasts: list[RequestOutput | None] = [None] * len(streams)

        async def on_output(prompt_index: int, output: RequestOutput) -> None:
            trackers[prompt_index].observe(output)
            lasts[prompt_index] = output
            for completion in output.outputs:
                index = job.choice_index(prompt_index, completion.index)
                state = states.get(index)
                if state is None:
                    state = states[index] = new_state()
                if state.done:
                    continue
                event = chunk(index, state, completion)
                state.done = completion.finish_reason is not None
                if event is not None:
                    await send_event(event if isinstance(event, str) else sse_event(event))
            if output.finished and any(c.finish_reason == "error" for c in output.outputs):
                await send_event(sse_event(json.loads(_request_failed(output).envelope())))

        try:
            if len(streams) == 1:  # most requests: no merging task per stream
                async for output in streams[0]:
                    await on_output(0, output)
            else:
                async for prompt_index, output in _merge(streams):
                    await on_output(prompt_index, output)
            if job.include_usage:
                await send_event(sse_event(usage_chunk(self._usage(job, lasts))))
        except (EngineStepError, EngineDeadError) as exc:
            await send_event(sse_event(json.loads(_engine_error(exc).envelope())))
        finally:
            self._abort_unfinished(streams)
        await send_event("data: [DONE]\n\n")

    def _holdback(self, job: _Job) -> int:
        return max((len(stop) for stop in job.params.stop), default=1) - 1

    def _stream_completion(self, job: _Job, streams: list[RequestStream]) -> Callable[[SendEvent], Awaitable[None]]:
        text_only = TextChunkTemplate(lambda index, text: CompletionStreamResponse(
            id=job.request_id, model=job.model, created=job.created,
            choices=[CompletionChoice(index=index, text=text)]))

        def chunk(index: int, state: _ChoiceState, out: CompletionOutput) -> BaseModel | str | None:
            if state.started and job.num_logprobs is None and out.finish_reason is None:
                text = state.text_delta(out)
                state.sent_tokens = len(out.token_ids)
                return text_only.event(index, text) if text else None
            prefix = ""
            if not state.started:
                echo = job.echo_texts[index // job.params.n]
                prefix, state.started, state.text_offset = echo, True, len(echo)
            text = prefix + state.text_delta(out)
            logprobs = None
            if job.num_logprobs is not None:
                logprobs = self._completion_logprobs(out, state.sent_tokens, job.num_logprobs, state.text_offset)
                state.text_offset += sum(len(token) for token in logprobs.tokens)
            state.sent_tokens = len(out.token_ids)
            finished = out.finish_reason is not None
            if not text and not finished and not (logprobs and logprobs.tokens):
                return None
            choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=out.finish_reason,
                                      stop_reason=out.stop_reason if finished else None)
            return CompletionStreamResponse(id=job.request_id, model=job.model, created=job.created, choices=[choice])

        def usage_chunk(usage: UsageInfo) -> BaseModel:
            return CompletionStreamResponse(id=job.request_id, model=job.model, created=job.created, choices=[],
                                            usage=usage)

        return functools.partial(self._write_events, job, streams, chunk, usage_chunk,
                                 lambda: _ChoiceState(holdback=self._holdback(job)))

    def _new_chat_state(self, job: _Job) -> _ChoiceState:
        assert job.chat is not None
        state = _ChoiceState(holdback=self._holdback(job))
        if job.chat.split_reasoning:
            state.reasoning = ReasoningStream(job.chat.thinking_open)
        if job.chat.tools:
            state.tools = ToolCallStream(job.chat.tools)
        return state

    def _chat_delta(self, job: _Job, index: int, state: _ChoiceState, out: CompletionOutput) -> DeltaMessage:
        """The message delta of one choice: reasoning, content and completed tool calls."""
        final = out.finish_reason is not None
        text = state.visible_text(out)
        delta = DeltaMessage()
        if state.reasoning is not None:
            reasoning_delta, text = state.reasoning.update(text, final)
            delta.reasoning_content = reasoning_delta or None
        if state.tools is not None:
            tools_delta = state.tools.update(text, final)
            delta.content = tools_delta.content or None
            delta.tool_calls = [DeltaToolCall(index=i, id=self._tool_call_id(job, index, i), type="function",
                                              function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                                for i, c in tools_delta.tool_calls] or None
        elif text.startswith(state.sent_content):
            delta.content = text[len(state.sent_content):] or None
            state.sent_content = text
        return delta

    def _stream_chat(self, job: _Job, streams: list[RequestStream]) -> Callable[[SendEvent], Awaitable[None]]:
        content_only = TextChunkTemplate(lambda index, text: ChatCompletionStreamResponse(
            id=job.request_id, model=job.model, created=job.created,
            choices=[ChatStreamChoice(index=index, delta=DeltaMessage(content=text))]))

        def chunk(index: int, state: _ChoiceState, out: CompletionOutput) -> BaseModel | str | None:
            if (state.started and state.reasoning is None and state.tools is None and job.num_logprobs is None
                    and out.finish_reason is None):
                text = state.visible_text(out)
                state.sent_tokens = len(out.token_ids)
                if not text.startswith(state.sent_content) or len(text) == len(state.sent_content):
                    return None
                content, state.sent_content = text[len(state.sent_content):], text
                return content_only.event(index, content)
            delta = self._chat_delta(job, index, state, out)
            if not state.started:
                delta.role = "assistant"
                if delta.content is None and delta.reasoning_content is None and not delta.tool_calls:
                    delta.content = ""
                state.started = True
            logprobs = None
            if job.num_logprobs is not None:
                logprobs = self._chat_logprobs(out, state.sent_tokens, job.num_logprobs)
            state.sent_tokens = len(out.token_ids)
            finished = out.finish_reason is not None
            empty = delta.content is None and delta.reasoning_content is None and not delta.tool_calls
            if empty and delta.role is None and not finished and not (logprobs and logprobs.content):
                return None
            has_calls = state.tools is not None and state.tools.num_calls > 0
            choice = ChatStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                      finish_reason=self._chat_finish_reason(out.finish_reason, has_calls))
            return ChatCompletionStreamResponse(id=job.request_id, model=job.model, created=job.created,
                                                choices=[choice])

        def usage_chunk(usage: UsageInfo) -> BaseModel:
            return ChatCompletionStreamResponse(id=job.request_id, model=job.model, created=job.created, choices=[],
                                                usage=usage)

        return functools.partial(self._write_events, job, streams, chunk, usage_chunk,
                                 lambda: self._new_chat_state(job))


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


# =========================================================================== app factory
def _preload_stream_backend() -> None:
    """Import anyio's asyncio backend now: a streamed response runs in an anyio task group, and
    the first one imports it lazily (~90 ms here), which would land in the first request's TTFT."""
    try:
        importlib.import_module("anyio._backends._asyncio")
    except ImportError:  # a future anyio may move it; the lazy import still works then
        logger.debug("anyio asyncio backend not preloaded")


def _lifespan(engine: AsyncLLMEngine, shutdown_engine: bool) -> Callable[[FastAPI], Any]:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            if shutdown_engine:
                await asyncio.to_thread(engine.shutdown)

    return lifespan


# Documented in /openapi.json: every error answers with the OpenAI envelope.
_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 503)}


def _install_routes(app: FastAPI, serving: OpenAIServing) -> None:
    @app.post("/v1/completions", responses={200: {"model": CompletionResponse}, **_ERROR_RESPONSES})
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await serving.completion(body, request)

    @app.post("/v1/chat/completions", responses={200: {"model": ChatCompletionResponse}, **_ERROR_RESPONSES})
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat_completion(body, request)

    @app.get("/v1/models")
    async def list_models() -> Response:
        return _json(serving.models())

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        return _json(serving.model_card(model_id))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return _json(await serving.tokenize(body))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return _json(await serving.detokenize(body))

    @app.get("/version")
    async def version() -> Response:
        return _json(VersionResponse(version=hybridserve.__version__))

    @app.get("/health")
    async def health() -> Response:
        if not serving.engine.is_running:
            reason = getattr(serving.engine, "dead_reason", None)
            raise APIError(503, f"engine is not running: {reason}" if reason else "engine is not running",
                           code="engine_unavailable")
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await serving.render_metrics(), media_type=METRICS_CONTENT_TYPE)


def build_app(engine: AsyncLLMEngine, *, model_name: str | Sequence[str], api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, shutdown_engine: bool = False,
              reasoning_parser: str | None = None, api_keys: Sequence[str] = (), stream_interval: int = 1) -> FastAPI:
    """Build the HTTP app around a started-or-not `AsyncLLMEngine`.

    `model_name` is the served name, or several aliases (the first is the default). The engine
    thread starts with the app; `shutdown_engine=True` stops it when the app stops. With
    `api_key` and/or `api_keys`, one of them is required as a bearer token on `/v1/*`, and each
    key's requests are cached under that key's own salt (see `server.auth`); bodies over
    `max_body_bytes` are answered with 413. `reasoning_parser="qwen3"` moves thinking text into
    `reasoning_content`. `stream_interval=k` sends a streamed response's text in chunks of k
    tokens after the first (SGLang's `--stream-interval`; see `SamplingParams.stream_interval`).
    The OpenAPI schema is at `/openapi.json`, its interactive page at `/docs`.
    """
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    serving = OpenAIServing(engine, model_name, reasoning_parser, stream_interval)
    _preload_stream_backend()
    app = FastAPI(title="hybridserve", lifespan=_lifespan(engine, shutdown_engine),
                  openapi_url="/openapi.json", docs_url="/docs", redoc_url=None)
    app.state.serving = serving
    _install_error_handlers(app)
    _install_routes(app, serving)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes)
    keyring = ApiKeyring([*api_keys, *([api_key] if api_key else [])])
    if len(keyring):
        app.add_middleware(TenantAuthMiddleware, keyring=keyring)
    return app

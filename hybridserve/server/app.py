"""The OpenAI-compatible HTTP app: `build_app(engine, ...)` returns a ready FastAPI instance.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (JSON or SSE streaming),
`GET /v1/models`, `GET /health`, `GET /metrics`, and the OpenAPI schema at `GET /openapi.json`
(interactive page `GET /docs`). Every error, including unknown routes,
answers with the OpenAI envelope `{"error": {"message", "type", "param", "code"}}`.
Two pure-ASGI middlewares guard the app: bearer-key auth on `/v1/*` and a body-size cap.
A request whose client disconnects is aborted in the engine, streaming or not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
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
from hybridserve.sampling_params import RequestOutput, SamplingParams
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
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
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


def _sse(payload: BaseModel | dict[str, Any]) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


def _finite(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


_TokenEntry = tuple[str, float, list[tuple[str, float]]]


@dataclasses.dataclass
class _Job:
    """One HTTP request's engine work: n engine requests over the same prompt."""

    request_id: str
    prompt_ids: list[int]
    params: list[SamplingParams]
    cache_salt: str | None
    num_logprobs: int | None
    include_usage: bool
    echo_text: str = ""
    arrival: float = dataclasses.field(default_factory=time.monotonic)

    def engine_id(self, index: int) -> str:
        """Engine request id of choice `index`."""
        return f"{self.request_id}-{index}"


@dataclasses.dataclass
class _ChoiceState:
    """What has been streamed so far for one choice."""

    tracker: RequestTracker
    sent_text: str = ""
    sent_tokens: int = 0
    text_offset: int = 0
    started: bool = False
    holdback: int = 0
    last: RequestOutput | None = None

    def text_delta(self, output: RequestOutput) -> str:
        """New text since the last chunk. While unfinished, the last `holdback` characters stay
        back: they may be the start of a stop string that the engine will cut."""
        text = output.text
        if not output.finished and self.holdback:
            text = text[:max(len(self.sent_text), len(text) - self.holdback)]
        if not text.startswith(self.sent_text):
            return ""
        delta = text[len(self.sent_text):]
        self.sent_text = text
        return delta


# =========================================================================== serving
class OpenAIServing:
    """Turns protocol requests into engine requests and engine outputs into responses."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.metrics = ServerMetrics()
        self.chat = ChatRenderer(getattr(engine.tokenizer, "chat_template", None))
        model_config = getattr(engine, "model_config", None)
        self.vocab_size: int | None = getattr(model_config, "vocab_size", None)

    # ------------------------------------------------------------- entry points
    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        """`POST /v1/completions`."""
        self._check_model(body.model)
        prompt = body.prompt_input
        prompt_ids = await self._encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = self._max_tokens(len(prompt_ids), body.max_tokens,
                                      "max_tokens" in body.model_fields_set, default=16, param="prompt")
        echo = "" if not body.echo else (prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt_ids))
        job = self._job("cmpl", body, prompt_ids, max_tokens, body.logprobs, echo)
        job.cache_salt = tenant_cache_salt(request_tenant(request.scope), job.cache_salt)
        streams = await self._submit(job)
        if body.stream:
            return self._event_stream(self._stream_completion(job, streams), streams)
        finals = await self._collect(job, streams, request)
        return _json(self._completion_response(job, finals))

    async def chat_completion(self, body: ChatCompletionRequest, request: Request) -> Response:
        """`POST /v1/chat/completions`."""
        self._check_model(body.model)
        try:
            text = self.chat.render([m.to_template_dict() for m in body.messages],
                                    add_generation_prompt=body.add_generation_prompt,
                                    extra=body.chat_template_kwargs)
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages", code="chat_template_error") from exc
        prompt_ids = await self._encode(text)
        max_tokens = self._max_tokens(len(prompt_ids), body.requested_max_tokens,
                                      body.requested_max_tokens is not None, default=None, param="messages")
        job = self._job("chatcmpl", body, prompt_ids, max_tokens, body.num_logprobs, "")
        job.cache_salt = tenant_cache_salt(request_tenant(request.scope), job.cache_salt)
        streams = await self._submit(job)
        if body.stream:
            return self._event_stream(self._stream_chat(job, streams), streams)
        finals = await self._collect(job, streams, request)
        return _json(self._chat_response(job, finals))

    async def render_metrics(self) -> bytes:
        """Prometheus text with fresh engine stats."""
        try:
            stats = await self.engine.stats()
        except EngineDeadError:
            stats = {}
        return self.metrics.render(stats)

    def models(self) -> ModelList:
        """`GET /v1/models`."""
        return ModelList(data=[ModelCard(id=self.model_name, max_model_len=self.engine.max_model_len)])

    # ------------------------------------------------------------- request preparation
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model `{model}` does not exist (serving `{self.model_name}`)",
                           param="model", code="model_not_found")

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

    def _job(self, prefix: str, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
             max_tokens: int, num_logprobs: int | None, echo_text: str) -> _Job:
        try:
            params = [body.sampling_params(max_tokens, num_logprobs, i) for i in range(body.n)]
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        for p in params:
            if self.vocab_size is not None and p.top_k > self.vocab_size:
                p.top_k = -1
        return _Job(f"{prefix}-{uuid.uuid4().hex}", prompt_ids, params, body.cache_salt,
                    num_logprobs, body.include_usage, echo_text)

    async def _submit(self, job: _Job) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for index, params in enumerate(job.params):
                streams.append(await self.engine.add_request(job.engine_id(index), job.prompt_ids,
                                                             params, job.cache_salt))
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

    def _usage(self, job: _Job, finals: list[RequestOutput | None]) -> UsageInfo:
        completion = sum(len(f.token_ids) for f in finals if f is not None)
        cached = finals[0].num_cached_tokens if finals and finals[0] is not None else 0
        prompt = len(job.prompt_ids)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    # ------------------------------------------------------------- logprobs
    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _token_entries(self, output: RequestOutput, start: int, k: int) -> list[_TokenEntry]:
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

    def _completion_logprobs(self, output: RequestOutput, start: int, k: int, offset: int) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for text, logprob, top in self._token_entries(output, start, k):
            result.tokens.append(text)
            result.token_logprobs.append(logprob)
            result.top_logprobs.append(dict(top))
            result.text_offset.append(offset)
            offset += len(text)
        return result

    def _chat_logprobs(self, output: RequestOutput, start: int, k: int) -> ChatChoiceLogprobs:
        content = [
            ChatTokenLogprob(token=text, logprob=logprob, bytes=list(text.encode()),
                             top_logprobs=[TopLogprob(token=t, logprob=v, bytes=list(t.encode())) for t, v in top])
            for text, logprob, top in self._token_entries(output, start, k)
        ]
        return ChatChoiceLogprobs(content=content)

    # ------------------------------------------------------------- non-streamed responses
    def _completion_response(self, job: _Job, finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for index, out in enumerate(finals):
            logprobs = None
            if job.num_logprobs is not None:
                logprobs = self._completion_logprobs(out, 0, job.num_logprobs, len(job.echo_text))
            choices.append(CompletionChoice(index=index, text=job.echo_text + out.text, logprobs=logprobs,
                                            finish_reason=out.finish_reason, stop_reason=out.stop_reason))
        return CompletionResponse(id=job.request_id, model=self.model_name, choices=choices,
                                  usage=self._usage(job, list(finals)))

    def _chat_response(self, job: _Job, finals: list[RequestOutput]) -> ChatCompletionResponse:
        choices = []
        for index, out in enumerate(finals):
            logprobs = None if job.num_logprobs is None else self._chat_logprobs(out, 0, job.num_logprobs)
            choices.append(ChatChoice(index=index, message=AssistantMessage(content=out.text), logprobs=logprobs,
                                      finish_reason=out.finish_reason, stop_reason=out.stop_reason))
        return ChatCompletionResponse(id=job.request_id, model=self.model_name, choices=choices,
                                      usage=self._usage(job, list(finals)))

    # ------------------------------------------------------------- streamed responses
    def _event_stream(self, chunks: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
        # The background task also covers a client gone before the body iterator ever started.
        return StreamingResponse(chunks, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                 background=BackgroundTask(self._abort_unfinished, streams))

    async def _stream_events(self, job: _Job, streams: list[RequestStream],
                             chunk: Callable[[int, _ChoiceState, RequestOutput], BaseModel | None],
                             usage_chunk: Callable[[UsageInfo], BaseModel]) -> AsyncIterator[str]:
        holdback = max((len(stop) for stop in job.params[0].stop), default=1) - 1
        states = [_ChoiceState(self.metrics.tracker(job.arrival), holdback=holdback) for _ in streams]
        try:
            async for index, output in _merge(streams):
                state = states[index]
                state.tracker.observe(output)
                state.last = output
                event = chunk(index, state, output)
                if event is not None:
                    yield _sse(event)
                if output.finished and output.finish_reason == "error":
                    yield _sse(json.loads(_request_failed(output).envelope()))
            if job.include_usage:
                yield _sse(usage_chunk(self._usage(job, [s.last for s in states])))
        except (EngineStepError, EngineDeadError) as exc:
            error = _engine_error(exc)
            yield _sse(json.loads(error.envelope()))
        finally:
            self._abort_unfinished(streams)
        yield "data: [DONE]\n\n"

    def _stream_completion(self, job: _Job, streams: list[RequestStream]) -> AsyncIterator[str]:
        def chunk(index: int, state: _ChoiceState, out: RequestOutput) -> BaseModel | None:
            prefix = ""
            if not state.started:
                prefix, state.started, state.text_offset = job.echo_text, True, len(job.echo_text)
            text = prefix + state.text_delta(out)
            logprobs = None
            if job.num_logprobs is not None:
                logprobs = self._completion_logprobs(out, state.sent_tokens, job.num_logprobs, state.text_offset)
                state.text_offset += sum(len(token) for token in logprobs.tokens)
            state.sent_tokens = len(out.token_ids)
            if not text and not out.finished and not (logprobs and logprobs.tokens):
                return None
            choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                      finish_reason=out.finish_reason if out.finished else None,
                                      stop_reason=out.stop_reason if out.finished else None)
            return CompletionStreamResponse(id=job.request_id, model=self.model_name, choices=[choice])

        def usage_chunk(usage: UsageInfo) -> BaseModel:
            return CompletionStreamResponse(id=job.request_id, model=self.model_name, choices=[], usage=usage)

        return self._stream_events(job, streams, chunk, usage_chunk)

    def _stream_chat(self, job: _Job, streams: list[RequestStream]) -> AsyncIterator[str]:
        def chunk(index: int, state: _ChoiceState, out: RequestOutput) -> BaseModel | None:
            delta = DeltaMessage(content=state.text_delta(out))
            if not state.started:
                delta.role = "assistant"
                state.started = True
            logprobs = None
            if job.num_logprobs is not None:
                logprobs = self._chat_logprobs(out, state.sent_tokens, job.num_logprobs)
            state.sent_tokens = len(out.token_ids)
            if not delta.content and delta.role is None and not out.finished and not (logprobs and logprobs.content):
                return None
            choice = ChatStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                      finish_reason=out.finish_reason if out.finished else None)
            return ChatCompletionStreamResponse(id=job.request_id, model=self.model_name, choices=[choice])

        def usage_chunk(usage: UsageInfo) -> BaseModel:
            return ChatCompletionStreamResponse(id=job.request_id, model=self.model_name, choices=[], usage=usage)

        return self._stream_events(job, streams, chunk, usage_chunk)


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


# =========================================================================== app factory
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

    @app.get("/health")
    async def health() -> Response:
        if not serving.engine.is_running:
            raise APIError(503, "engine is not running", code="engine_unavailable")
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await serving.render_metrics(), media_type=METRICS_CONTENT_TYPE)


def build_app(engine: AsyncLLMEngine, *, model_name: str, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, shutdown_engine: bool = False,
              api_keys: Sequence[str] = ()) -> FastAPI:
    """Build the HTTP app around a started-or-not `AsyncLLMEngine`.

    The engine thread starts with the app; `shutdown_engine=True` stops it when the app stops.
    With `api_key` and/or `api_keys`, one of them is required as a bearer token on `/v1/*`, and
    each key's requests are cached under that key's own salt (see `server.auth`); bodies over
    `max_body_bytes` are answered with 413. The OpenAPI schema is at `/openapi.json`, its
    interactive page at `/docs`.
    """
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    serving = OpenAIServing(engine, model_name)
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

"""What the endpoint handlers share: `ServingContext` (engine, served names, chat renderer,
metrics) and `OpenAIServing`: request preparation, one engine request per prompt, a JSON response
once the outputs are final or server-sent events as they come, usage and logprob rows."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.background import BackgroundTask

from hybridserve.engine.protocol import EngineClient, RequestOutputStream
from hybridserve.errors import EngineDeadError, EngineStepError, RequestAbortedError
from hybridserve.sampling_params import (
    MAX_STREAM_INTERVAL,
    CompletionOutput,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from hybridserve.server.auth import request_tenant, tenant_cache_salt
from hybridserve.server.chat import ChatRenderer, ChatTemplateError
from hybridserve.server.errors import APIError, engine_error, request_failed
from hybridserve.server.limits import (
    DEFAULT_LIMITS,
    ServerLimits,
    TenantAdmission,
    TenantTicket,
    check_logit_bias,
    check_prompt_count,
    check_schema,
    check_stop,
    check_token_ids,
)
from hybridserve.server.metrics import RequestTracker, ServerMetrics
from hybridserve.server.middleware import log_safe
from hybridserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionRequest,
    CompletionStreamResponse,
    LenientModel,
    PromptTokensDetails,
    UsageInfo,
    now,
)
from hybridserve.server.reasoning_parser import REASONING_PARSERS, ReasoningStream
from hybridserve.server.sse import EventStreamResponse, SendEvent, TextChunkTemplate, sse_event
from hybridserve.server.tool_parser import ToolCallStream

logger = logging.getLogger(__name__)

MIN_LOGPROB = -9999.0  # a -inf logprob is sent as this (JSON has no infinity)
MAX_LOGGED_FIELDS = 32  # unknown field names named in one warning line (the rest are counted)
TokenEntry = tuple[str, float, list[tuple[str, float]]]


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def merge_streams(streams: list[RequestOutputStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as `(choice index, output)` pairs."""
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestOutputStream) -> None:
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


def finite(value: float) -> float:
    """A logprob JSON can carry (-inf becomes MIN_LOGPROB)."""
    return value if math.isfinite(value) else MIN_LOGPROB


@dataclasses.dataclass
class ChatOptions:
    """How a chat job's output text becomes a message."""

    tools: list[dict[str, Any]] | None     # parse tool calls against these (None: no parsing)
    split_reasoning: bool                   # a reasoning parser is configured
    thinking_open: bool                     # the prompt ends inside an open <think> block
    forced_tools: bool = False              # tool_choice "required" or a named function: all output is calls


@dataclasses.dataclass
class Job:
    """One HTTP request's engine work: one engine request (with `n` completions) per prompt."""

    request_id: str
    model: str
    prompts: list[list[int]]
    params: SamplingParams
    cache_salt: str | None
    num_logprobs: int | None
    include_usage: bool
    echo_texts: list[str]
    tenant: str | None = None
    chat: ChatOptions | None = None
    echo_only: bool = False  # completions' echo with max_tokens 0: the one generated token is dropped
    # echoed prompts' logprobs by prompt index, as a stream's first output brings them
    prompt_logprobs: dict[int, list[dict[int, float] | None]] = dataclasses.field(default_factory=dict)
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    created: int = dataclasses.field(default_factory=now)  # one `created` for every chunk, as OpenAI sends

    def choice_index(self, prompt_index: int, completion_index: int) -> int:
        """OpenAI choice index: prompt-major, then completion."""
        return prompt_index * self.params.n + completion_index


@dataclasses.dataclass
class ChoiceState:
    """What has been streamed so far for one choice. A streamed job's engine outputs are deltas
    (`RequestOutputKind.DELTA`: new text and tokens only; the stream holds back text a stop string
    may still cut), so each chunk costs what it carries."""

    sent_tokens: int = 0
    text_offset: int = 0
    started: bool = False
    done: bool = False
    reasoning: ReasoningStream | None = None
    tools: ToolCallStream | None = None

    @classmethod
    def for_job(cls, job: Job) -> ChoiceState:
        """A fresh state, with the reasoning and tool-call parsers the job asks for."""
        state = cls()
        if job.chat is not None and job.chat.split_reasoning:
            state.reasoning = ReasoningStream(job.chat.thinking_open)
        if job.chat is not None and job.chat.tools:
            state.tools = ToolCallStream(job.chat.tools, forced=job.chat.forced_tools)
        return state


def json_response(model: BaseModel, status: int = 200) -> Response:
    """A pydantic model as a JSON response."""
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


@dataclasses.dataclass
class ServingContext:
    """What every handler of one app shares."""

    engine: EngineClient
    model_names: list[str]
    reasoning_parser: str | None
    stream_interval: int
    metrics: ServerMetrics
    chat: ChatRenderer
    limits: ServerLimits
    admission: TenantAdmission

    @property
    def max_waiting_requests(self) -> int | None:
        """The engine client's waiting-queue limit (None: unbounded)."""
        return getattr(self.engine, "max_waiting_requests", None)

    @classmethod
    def create(cls, engine: EngineClient, model_names: str | Sequence[str], reasoning_parser: str | None = None,
               stream_interval: int = 1, limits: ServerLimits = DEFAULT_LIMITS) -> ServingContext:
        """Check the server options and build the shared state (`ValueError` on a bad option)."""
        if not isinstance(stream_interval, int) or not 1 <= stream_interval <= MAX_STREAM_INTERVAL:
            raise ValueError(f"stream_interval must be an integer in [1, {MAX_STREAM_INTERVAL}], "
                             f"got {stream_interval!r}")
        names = [model_names] if isinstance(model_names, str) else list(model_names)
        if not names:
            raise ValueError("at least one served model name is needed")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r} (known: {', '.join(REASONING_PARSERS)})")
        admission = TenantAdmission(limits.tenant_cap(getattr(engine, "max_waiting_requests", None)))
        return cls(engine, names, reasoning_parser, stream_interval, ServerMetrics(),
                   ChatRenderer(getattr(engine.tokenizer, "chat_template", None)), limits, admission)


class OpenAIServing:
    """Base of the endpoint handlers: turns protocol requests into engine requests and engine
    outputs into responses. A generating handler sets `chunk_type` and the three response hooks."""

    chunk_type: type[CompletionStreamResponse] | type[ChatCompletionStreamResponse]

    def __init__(self, context: ServingContext) -> None:
        self.context = context
        self.engine = context.engine
        self.model_names = context.model_names
        self.tokenizer = context.engine.tokenizer
        self.metrics = context.metrics
        self.limits = context.limits
        model_config = getattr(context.engine, "model_config", None)
        self.vocab_size: int | None = getattr(model_config, "vocab_size", None)

    def _response(self, job: Job, finals: list[RequestOutput]) -> BaseModel:
        """The JSON body of a job whose outputs are final."""
        raise NotImplementedError

    def _stream_choice(self, job: Job, index: int, state: ChoiceState, out: CompletionOutput) -> BaseModel | None:
        """The choice of a stream chunk for an output (None: nothing to send yet)."""
        raise NotImplementedError

    def _text_choice(self, index: int, text: str) -> BaseModel:
        """The choice of a stream chunk that carries new text and nothing else."""
        raise NotImplementedError

    def _check_model(self, model: str | None) -> str:
        """The served name a request uses (404 for an unknown one)."""
        if model is None:
            return self.model_names[0]
        if model not in self.model_names:
            raise APIError(404, f"the model `{log_safe(model)}` does not exist (serving {', '.join(self.model_names)})",
                           param="model", code="model_not_found")
        return model

    @staticmethod
    def _log_ignored(kind: str, body: LenientModel) -> None:
        """One warning naming the unknown fields: escaped, cut, and at most MAX_LOGGED_FIELDS of them."""
        ignored = body.ignored_fields()
        if ignored:
            names = sorted(ignored)
            more = f" (+{len(names) - MAX_LOGGED_FIELDS} more)" if len(names) > MAX_LOGGED_FIELDS else ""
            logger.warning("%s request: ignored unknown field(s): %s%s", kind,
                           ", ".join(log_safe(name) for name in names[:MAX_LOGGED_FIELDS]), more)

    def _check_bounds(self, body: CompletionRequest | ChatCompletionRequest, num_prompts: int) -> None:
        """The request limits every generating request is checked against before any work is done
        for it (400 over one of them); token-id prompts are checked by `_check_prompt_ids`."""
        check_prompt_count(num_prompts, self.context.max_waiting_requests, self.limits)
        check_stop(body.stop, body.stop_token_ids, self.vocab_size, self.limits)
        check_logit_bias(body.logit_bias, self.limits)
        extra = body.structured_outputs
        constraints: list[Any] = [body.guided_json, body.guided_regex, body.guided_choice, body.guided_grammar]
        if extra is not None:
            constraints += [extra.json_, extra.regex, extra.choice, extra.grammar]
        for constraint in constraints:
            check_schema(constraint, self.limits, "structured_outputs")

    def _check_prompt_ids(self, prompts: Sequence[str | list[int]]) -> None:
        """Token-id prompts hold only ids of the vocabulary."""
        for prompt in prompts:
            if not isinstance(prompt, str):
                check_token_ids(prompt, self.vocab_size, "prompt")

    def _render_chat(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None,
                     kwargs: dict[str, Any] | None, add_generation_prompt: bool) -> str:
        try:
            return self.context.chat.render([m.to_template_dict() for m in messages],
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

    def _job(self, prefix: str, model: str, body: CompletionRequest | ChatCompletionRequest, request: Request,
             prompts: list[list[int]], max_tokens: int, num_logprobs: int | None, echo_texts: list[str],
             structured: StructuredOutputsParams | None, chat: ChatOptions | None = None) -> Job:
        try:
            params = body.sampling_params(max_tokens, num_logprobs, structured)
            if not body.stream:  # the response is built from the final output alone
                params.output_kind = RequestOutputKind.FINAL_ONLY
            else:
                params.output_kind = RequestOutputKind.DELTA
                params.stream_interval = self.context.stream_interval
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        if self.vocab_size is not None and params.top_k > self.vocab_size:
            params.top_k = -1
        if self.vocab_size is not None and any(t >= self.vocab_size for t in params.logit_bias or {}):
            raise APIError(400, f"logit_bias names a token id outside the vocabulary [0, {self.vocab_size})",
                           param="logit_bias")
        tenant = request_tenant(request.scope)
        cache_salt = tenant_cache_salt(tenant, body.cache_salt)
        return Job(f"{prefix}-{uuid.uuid4().hex}", model, prompts, params, cache_salt,
                   num_logprobs, body.include_usage, echo_texts, tenant, chat)

    async def _respond(self, job: Job, streaming: bool | None, request: Request) -> Response:
        """Submit `job` and answer: its chunks as server-sent events when it streams, else the JSON
        body. The job holds its tenant's places (`TenantAdmission`) until its streams end."""
        ticket = self.context.admission.admit(job.tenant, len(job.prompts))
        streams: list[RequestOutputStream] = []
        try:
            for index, prompt_ids in enumerate(job.prompts):
                streams.append(await self.engine.add_request(f"{job.request_id}-{index}", prompt_ids,
                                                             job.params, job.cache_salt))
        except BaseException as exc:
            ticket.release()
            for stream in streams:
                self.engine.abort(stream.request_id)
            if isinstance(exc, Exception):
                raise engine_error(exc) from exc
            raise
        if streaming:
            # The background task also covers a client gone before the events ever started.
            return EventStreamResponse(functools.partial(self._write_events, job, streams, ticket),
                                       background=BackgroundTask(self._abort_after_stream, streams, ticket))
        try:
            return json_response(self._response(job, await self._collect(job, streams, request)))
        finally:
            ticket.release()

    async def _collect(self, job: Job, streams: list[RequestOutputStream], request: Request) -> list[RequestOutput]:
        """The final output of every stream; a client that leaves first aborts them all (499)."""
        trackers = [self.metrics.tracker(job.arrival) for _ in streams]

        async def final(stream: RequestOutputStream, tracker: RequestTracker) -> RequestOutput:
            last: RequestOutput | None = None
            async for output in stream:
                tracker.observe(output)
                last = output
            assert last is not None
            return last

        finals = asyncio.ensure_future(asyncio.gather(*(final(s, t) for s, t in zip(streams, trackers))))
        watcher: asyncio.Future[Any] = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait({finals, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if finals not in done:
                finals.cancel()
                await asyncio.gather(finals, return_exceptions=True)
                raise engine_error(RequestAbortedError("client disconnected"))
            return finals.result()
        except (EngineStepError, EngineDeadError) as exc:
            raise engine_error(exc) from exc
        finally:
            watcher.cancel()
            self._abort_unfinished(streams)

    def _abort_unfinished(self, streams: list[RequestOutputStream]) -> None:
        for stream in streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)

    async def _abort_after_stream(self, streams: list[RequestOutputStream], ticket: TenantTicket) -> None:
        """A streamed response's background task. Aborting never blocks, and as a coroutine it
        runs on the event loop; Starlette would hand a plain function to a worker thread."""
        ticket.release()
        self._abort_unfinished(streams)

    def _usage(self, job: Job, finals: Sequence[RequestOutput | None], completion: int | None = None) -> UsageInfo:
        """Token counts; `completion` given by a stream (its outputs were deltas), else counted."""
        if completion is None:
            completion = sum(len(o.token_ids) for f in finals if f is not None for o in f.outputs)
        cached = sum(f.num_cached_tokens for f in finals if f is not None)
        prompt = sum(len(ids) for ids in job.prompts)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def _token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def _token_entries(self, output: CompletionOutput, start: int, k: int) -> list[TokenEntry]:
        """(token text, its logprob, top-k alternatives) for `output`'s tokens from `start` on."""
        entries = []
        table = output.logprobs or []
        for i in range(start, len(output.token_ids)):
            token_id = output.token_ids[i]
            row = table[i] if i < len(table) else {}
            top = sorted(row.items(), key=lambda item: -item[1])[:k]
            entries.append((self._token_text(token_id), finite(row.get(token_id, MIN_LOGPROB)),
                            [(self._token_text(t), finite(v)) for t, v in top]))
        return entries

    def _chunk(self, job: Job, choices: list[Any], usage: UsageInfo | None = None) -> BaseModel:
        return self.chunk_type(id=job.request_id, model=job.model, created=job.created, choices=choices, usage=usage)

    async def _write_events(self, job: Job, streams: list[RequestOutputStream], ticket: TenantTicket,
                            send_event: SendEvent) -> None:
        text_only = TextChunkTemplate(lambda index, text: self._chunk(job, [self._text_choice(index, text)]))
        states: dict[int, ChoiceState] = {}
        trackers = [self.metrics.tracker(job.arrival) for _ in streams]
        lasts: list[RequestOutput | None] = [None] * len(streams)

        async def on_output(prompt_index: int, output: RequestOutput) -> None:
            trackers[prompt_index].observe(output, delta=True)
            lasts[prompt_index] = output
            if output.prompt_logprobs is not None:
                job.prompt_logprobs[prompt_index] = output.prompt_logprobs
            for out in output.outputs:
                index = job.choice_index(prompt_index, out.index)
                state = states.get(index)
                if state is None:
                    state = states[index] = ChoiceState.for_job(job)
                if state.done:
                    continue
                state.done = out.finish_reason is not None
                if (state.started and state.reasoning is None and state.tools is None and job.num_logprobs is None
                        and not state.done):  # the common chunk: new text alone, without pydantic
                    state.sent_tokens += len(out.token_ids)
                    if out.text:
                        await send_event(text_only.event(index, out.text))
                    continue
                choice = self._stream_choice(job, index, state, out)
                if choice is not None:
                    await send_event(sse_event(self._chunk(job, [choice])))
            if output.finished and any(c.finish_reason == "error" for c in output.outputs):
                await send_event(sse_event(json.loads(request_failed(output).envelope())))

        try:
            if len(streams) == 1:  # most requests: no merging task per stream
                async for output in streams[0]:
                    await on_output(0, output)
            else:
                async for prompt_index, output in merge_streams(streams):
                    await on_output(prompt_index, output)
            if job.include_usage:
                completion = sum(state.sent_tokens for state in states.values())
                await send_event(sse_event(self._chunk(job, [], self._usage(job, lasts, completion))))
        except (EngineStepError, EngineDeadError) as exc:
            await send_event(sse_event(json.loads(engine_error(exc).envelope())))
        finally:
            ticket.release()
            self._abort_unfinished(streams)
        await send_event("data: [DONE]\n\n")

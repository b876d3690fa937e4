"""`POST /v1/chat/completions`: the chat template renders the messages; the output text is split
into content, reasoning (`--reasoning-parser`) and tool calls, in a JSON response or streamed as
server-sent events; `response_format`, forced tool calls and vLLM's structured outputs become
grammars. (The template rendering itself is `server.chat`.)"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

from hybridserve.engine.protocol import RequestOutputStream
from hybridserve.sampling_params import (
    CompletionOutput,
    RequestOutput,
    StructuredOutputsParams,
)
from hybridserve.server.auth import request_tenant, tenant_cache_salt
from hybridserve.server.errors import ERROR_RESPONSES
from hybridserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    NamedToolChoice,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
)
from hybridserve.server.reasoning_parser import (
    THINK_END,
    ReasoningStream,
    prompt_opens_thinking,
    split_reasoning,
)
from hybridserve.server.serving import (
    ChatOptions,
    ChoiceState,
    Job,
    OpenAIServing,
    json_response,
)
from hybridserve.server.sse import SendEvent, TextChunkTemplate
from hybridserve.server.tool_grammar import tool_call_grammar
from hybridserve.server.tool_parser import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    ParsedToolCall,
    ToolCallStream,
    parse_tool_calls,
)


class _MessageParts(NamedTuple):
    """A chat completion's text split into content, reasoning and tool calls."""

    content: str
    reasoning: str | None
    tool_calls: list[ParsedToolCall]


class ChatServing(OpenAIServing):
    """The handler of `POST /v1/chat/completions`."""

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
        options = ChatOptions(tools=body.tool_dicts, split_reasoning=self.reasoning_parser is not None,
                               thinking_open=prompt_opens_thinking(text))
        job = self._job("chatcmpl", model, body, [prompt_ids], max_tokens, body.num_logprobs, [""], structured)
        job.chat = options
        job.cache_salt = tenant_cache_salt(request_tenant(request.scope), job.cache_salt)
        streams = await self._submit(job)
        if body.stream:
            return self._event_stream(self._stream_chat(job, streams), streams)
        finals = await self._collect(job, streams, request)
        return json_response(self._chat_response(job, finals[0]))

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


    def _chat_logprobs(self, output: CompletionOutput, start: int, k: int) -> ChatChoiceLogprobs:
        content = [
            ChatTokenLogprob(token=text, logprob=logprob, bytes=list(text.encode()),
                             top_logprobs=[TopLogprob(token=t, logprob=v, bytes=list(t.encode())) for t, v in top])
            for text, logprob, top in self._token_entries(output, start, k)
        ]
        return ChatChoiceLogprobs(content=content)

    # ------------------------------------------------------------- chat message parts
    def _message_parts(self, options: ChatOptions, text: str) -> _MessageParts:
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
    def _tool_call_id(job: Job, choice: int, call: int) -> str:
        return f"call_{job.request_id.rsplit('-', 1)[-1][:16]}_{choice}_{call}"

    @staticmethod
    def _chat_finish_reason(reason: str | None, has_calls: bool) -> str | None:
        return "tool_calls" if has_calls and reason == "stop" else reason

    def _chat_response(self, job: Job, final: RequestOutput) -> ChatCompletionResponse:
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

    def _new_chat_state(self, job: Job) -> ChoiceState:
        assert job.chat is not None
        state = ChoiceState(holdback=self._holdback(job))
        if job.chat.split_reasoning:
            state.reasoning = ReasoningStream(job.chat.thinking_open)
        if job.chat.tools:
            state.tools = ToolCallStream(job.chat.tools)
        return state

    def _chat_delta(self, job: Job, index: int, state: ChoiceState, out: CompletionOutput) -> DeltaMessage:
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

    def _stream_chat(self, job: Job, streams: list[RequestOutputStream]) -> Callable[[SendEvent], Awaitable[None]]:
        content_only = TextChunkTemplate(lambda index, text: ChatCompletionStreamResponse(
            id=job.request_id, model=job.model, created=job.created,
            choices=[ChatStreamChoice(index=index, delta=DeltaMessage(content=text))]))

        def chunk(index: int, state: ChoiceState, out: CompletionOutput) -> BaseModel | str | None:
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


def install_chat_routes(app: FastAPI, serving: ChatServing) -> None:
    """Route `POST /v1/chat/completions` to `serving`."""

    @app.post("/v1/chat/completions", responses={200: {"model": ChatCompletionResponse}, **ERROR_RESPONSES})
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat_completion(body, request)


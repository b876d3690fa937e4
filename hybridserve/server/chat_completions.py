"""`POST /v1/chat/completions`: messages rendered by the chat template; the output split into
content, reasoning and tool calls; `response_format`, forced tool calls and vLLM's structured
outputs become grammars."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from hybridserve.sampling_params import CompletionOutput, RequestOutput, StructuredOutputsParams
from hybridserve.server.errors import ERROR_RESPONSES
from hybridserve.server.limits import check_schema, check_tools
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
)
from hybridserve.server.reasoning_parser import THINK_END, prompt_opens_thinking, split_reasoning
from hybridserve.server.serving import ChatOptions, ChoiceState, Job, OpenAIServing
from hybridserve.server.tool_grammar import tool_call_grammar
from hybridserve.server.tool_parser import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    ParsedToolCall,
    ToolCallPiece,
    parse_forced_tool_calls,
    parse_tool_calls,
)


class ChatServing(OpenAIServing):
    """The handler of `POST /v1/chat/completions`."""

    chunk_type = ChatCompletionStreamResponse

    async def chat_completion(self, body: ChatCompletionRequest, request: Request) -> Response:
        """`POST /v1/chat/completions`."""
        model = self._check_model(body.model)
        self._log_ignored("chat completion", body)
        self._check_bounds(body, 1)
        check_tools([tool.template_dict() for tool in body.tools or ()], self.limits)
        if body.response_format is not None and body.response_format.json_schema is not None:
            check_schema(body.response_format.json_schema.json_schema, self.limits, "response_format")
        structured = self._constraint(lambda: self._chat_constraint(body))
        text = self._render_chat(body.messages, body.tool_dicts, body.chat_template_kwargs,
                                 body.add_generation_prompt)
        if structured is not None and prompt_opens_thinking(text):
            text += f"{THINK_END}\n\n"  # a grammar constrains the answer: close the thinking block first
        prompt_ids = await self._encode(text)
        max_tokens = self._max_tokens(len(prompt_ids), body.requested_max_tokens,
                                      body.requested_max_tokens is not None, default=None, param="messages")
        forced = bool(body.tool_dicts) and (body.tool_choice == "required"
                                            or isinstance(body.tool_choice, NamedToolChoice))
        options = ChatOptions(tools=body.tool_dicts, split_reasoning=self.context.reasoning_parser is not None,
                              thinking_open=prompt_opens_thinking(text), forced_tools=forced)
        job = self._job("chatcmpl", model, body, request, [prompt_ids], max_tokens, body.num_logprobs, [""],
                        structured, options)
        return await self._respond(job, body.stream, request)

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

    def _logprobs(self, output: CompletionOutput, start: int, k: int) -> ChatChoiceLogprobs:
        content = [
            ChatTokenLogprob(token=text, logprob=logprob, bytes=list(text.encode()),
                             top_logprobs=[TopLogprob(token=t, logprob=v, bytes=list(t.encode())) for t, v in top])
            for text, logprob, top in self._token_entries(output, start, k)
        ]
        return ChatChoiceLogprobs(content=content)

    @staticmethod
    def _tool_call_id(job: Job, choice: int, call: int) -> str:
        return f"call_{job.request_id.rsplit('-', 1)[-1][:16]}_{choice}_{call}"

    def _tool_call_piece(self, job: Job, choice: int, piece: ToolCallPiece) -> DeltaToolCall:
        """A streamed piece of a call, as OpenAI sends it: the first with id, type and name."""
        if piece.name is None:
            return DeltaToolCall(index=piece.call_index, function=DeltaFunctionCall(arguments=piece.arguments))
        return DeltaToolCall(index=piece.call_index, id=self._tool_call_id(job, choice, piece.call_index),
                             type="function", function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments))

    @staticmethod
    def _finish_reason(reason: str | None, has_calls: bool) -> str | None:
        return "tool_calls" if has_calls and reason == "stop" else reason

    def _response(self, job: Job, finals: list[RequestOutput]) -> ChatCompletionResponse:
        assert job.chat is not None
        choices = []
        for out in finals[0].outputs:  # a chat job has one prompt
            content, reasoning = out.text, None  # split into content, reasoning and calls (the parsers never raise)
            if job.chat.split_reasoning:
                split = split_reasoning(content, job.chat.thinking_open)
                content, reasoning = split.content, split.reasoning
            parsed: list[ParsedToolCall] = []
            if job.chat.forced_tools:  # all output is calls: none of it is content, even cut short
                content, parsed = "", parse_forced_tool_calls(content, job.chat.tools)
            elif job.chat.tools:
                content, parsed = parse_tool_calls(content, job.chat.tools)
            calls = [ToolCallOut(id=self._tool_call_id(job, out.index, i),
                                 function=FunctionCallOut(name=c.name, arguments=c.arguments))
                     for i, c in enumerate(parsed)]
            message = AssistantMessage(content=content if content or not calls else None,
                                       reasoning_content=reasoning, tool_calls=calls)
            logprobs = None if job.num_logprobs is None else self._logprobs(out, 0, job.num_logprobs)
            choices.append(ChatChoice(index=out.index, message=message, logprobs=logprobs,
                                      finish_reason=self._finish_reason(out.finish_reason, bool(calls)),
                                      stop_reason=out.stop_reason))
        return ChatCompletionResponse(id=job.request_id, model=job.model, choices=choices,
                                      usage=self._usage(job, finals))

    def _text_choice(self, index: int, text: str) -> ChatStreamChoice:
        return ChatStreamChoice(index=index, delta=DeltaMessage(content=text))

    def _stream_choice(self, job: Job, index: int, state: ChoiceState,
                       out: CompletionOutput) -> ChatStreamChoice | None:
        """The reasoning, content and tool-call pieces that `out` (a delta) adds to one choice."""
        finished = out.finish_reason is not None
        text = out.text
        delta = DeltaMessage()
        if state.reasoning is not None:
            reasoning_delta, text = state.reasoning.update(text, finished)
            delta.reasoning_content = reasoning_delta or None
        if state.tools is not None:
            tools_delta = state.tools.update(text, finished)
            delta.content = tools_delta.content or None
            delta.tool_calls = [self._tool_call_piece(job, index, piece) for piece in tools_delta.tool_calls] or None
        else:
            delta.content = text or None
        empty = delta.content is None and delta.reasoning_content is None and not delta.tool_calls
        if not state.started:
            delta.role, state.started = "assistant", True
            delta.content = "" if empty else delta.content
        logprobs = None if job.num_logprobs is None else self._logprobs(out, 0, job.num_logprobs)
        state.sent_tokens += len(out.token_ids)
        if empty and delta.role is None and not finished and not (logprobs and logprobs.content):
            return None
        has_calls = state.tools is not None and state.tools.num_calls > 0
        return ChatStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                finish_reason=self._finish_reason(out.finish_reason, has_calls))


def install_chat_routes(app: FastAPI, serving: ChatServing) -> None:
    """Route `POST /v1/chat/completions` to `serving`."""

    @app.post("/v1/chat/completions", responses={200: {"model": ChatCompletionResponse}, **ERROR_RESPONSES})
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat_completion(body, request)

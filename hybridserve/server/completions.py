"""`POST /v1/completions`: one prompt or a batch of them, JSON or streamed as server-sent events,
with echo, logprobs and structured outputs."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from hybridserve.sampling_params import CompletionOutput, RequestOutput
from hybridserve.server.errors import ERROR_RESPONSES
from hybridserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from hybridserve.server.serving import ChoiceState, Job, OpenAIServing


class CompletionServing(OpenAIServing):
    """The handler of `POST /v1/completions`."""

    chunk_type = CompletionStreamResponse

    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        """`POST /v1/completions` (one prompt or a batch of them)."""
        model = self._check_model(body.model)
        self._log_ignored("completion", body)
        self._check_bounds(body, len(body.prompt_inputs))
        self._check_prompt_ids(body.prompt_inputs)
        prompts = [await self._encode(p) if isinstance(p, str) else list(p) for p in body.prompt_inputs]
        max_tokens = min(self._max_tokens(len(ids), body.max_tokens, "max_tokens" in body.model_fields_set,
                                          default=16, param="prompt") for ids in prompts)
        echo = [""] * len(prompts)
        if body.echo:
            echo = [p if isinstance(p, str) else self.tokenizer.decode(ids)
                    for p, ids in zip(body.prompt_inputs, prompts)]
        structured = self._constraint(body.structured_output_params)
        job = self._job("cmpl", model, body, request, prompts, max_tokens, body.logprobs, echo, structured)
        return await self._respond(job, body.stream, request)

    def _logprobs(self, output: CompletionOutput, start: int, k: int, offset: int) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for text, logprob, top in self._token_entries(output, start, k):
            result.tokens.append(text)
            result.token_logprobs.append(logprob)
            result.top_logprobs.append(dict(top))
            result.text_offset.append(offset)
            offset += len(text)
        return result

    def _response(self, job: Job, finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for prompt_index, final in enumerate(finals):
            echo = job.echo_texts[prompt_index]
            for out in final.outputs:
                logprobs = None if job.num_logprobs is None else self._logprobs(out, 0, job.num_logprobs, len(echo))
                choices.append(CompletionChoice(index=job.choice_index(prompt_index, out.index), text=echo + out.text,
                                                logprobs=logprobs, finish_reason=out.finish_reason,
                                                stop_reason=out.stop_reason))
        return CompletionResponse(id=job.request_id, model=job.model, choices=choices, usage=self._usage(job, finals))

    def _text_choice(self, index: int, text: str) -> CompletionChoice:
        return CompletionChoice(index=index, text=text)

    def _stream_choice(self, job: Job, index: int, state: ChoiceState,
                       out: CompletionOutput) -> CompletionChoice | None:
        prefix = ""
        if not state.started:
            echo = job.echo_texts[index // job.params.n]
            prefix, state.started, state.text_offset = echo, True, len(echo)
        text = prefix + out.text  # `out` is a delta: only what is new
        logprobs = None
        if job.num_logprobs is not None:
            logprobs = self._logprobs(out, 0, job.num_logprobs, state.text_offset)
            state.text_offset += sum(len(token) for token in logprobs.tokens)
        state.sent_tokens += len(out.token_ids)
        finished = out.finish_reason is not None
        if not text and not finished and not (logprobs and logprobs.tokens):
            return None
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=out.finish_reason,
                                stop_reason=out.stop_reason if finished else None)


def install_completion_routes(app: FastAPI, serving: CompletionServing) -> None:
    """Route `POST /v1/completions` to `serving`."""

    @app.post("/v1/completions", responses={200: {"model": CompletionResponse}, **ERROR_RESPONSES})
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await serving.completion(body, request)

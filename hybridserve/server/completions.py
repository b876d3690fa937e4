"""`POST /v1/completions`: one prompt or a batch of them, JSON or streamed as server-sent events,
with echo, logprobs (of the prompt too, with echo) and structured outputs."""

from __future__ import annotations

from collections.abc import Sequence

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
from hybridserve.server.serving import MIN_LOGPROB, ChoiceState, Job, OpenAIServing, finite

PromptLogprobs = Sequence[dict[int, float] | None]


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
        # echo with max_tokens 0 still runs the prompt: one token is generated (and dropped), as in vLLM
        job = self._job("cmpl", model, body, request, prompts, max(max_tokens, 1), body.logprobs, echo, structured)
        job.echo_only = body.echo_only
        return await self._respond(job, body.stream, request)

    def _logprobs(self, output: CompletionOutput, start: int, k: int, offset: int,
                  result: CompletionLogprobs | None = None) -> CompletionLogprobs:
        """`output`'s tokens from `start` on, appended to `result` (a new one by default)."""
        result = result if result is not None else CompletionLogprobs()
        for text, logprob, top in self._token_entries(output, start, k):
            result.tokens.append(text)
            result.token_logprobs.append(logprob)
            result.top_logprobs.append(dict(top))
            result.text_offset.append(offset)
            offset += len(text)
        return result

    def _prompt_logprobs(self, prompt_ids: list[int], rows: PromptLogprobs | None, k: int) -> CompletionLogprobs:
        """An echoed prompt's tokens with their logprobs (null for the first token, which nothing
        predicts), offsets from the start of the echoed text."""
        result = CompletionLogprobs()
        offset = 0
        for position, token_id in enumerate(prompt_ids):
            text = self._token_text(token_id)
            row = rows[position] if rows is not None and position < len(rows) else None
            result.tokens.append(text)
            result.text_offset.append(offset)
            offset += len(text)
            if row is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(finite(row.get(token_id, MIN_LOGPROB)))
            top = sorted(row.items(), key=lambda item: -item[1])[:k]
            result.top_logprobs.append({self._token_text(t): finite(v) for t, v in top})
        return result

    def _choice_logprobs(self, job: Job, prompt_index: int, rows: PromptLogprobs | None, out: CompletionOutput,
                         offset: int) -> CompletionLogprobs | None:
        """A choice's logprobs: the echoed prompt's first (when echoed), then the completion's
        (none for echo with max_tokens 0); `offset` is where the completion's text starts."""
        k = job.num_logprobs
        if k is None:
            return None
        result = self._prompt_logprobs(job.prompts[prompt_index], rows, k) if job.echo_texts[prompt_index] else None
        if job.echo_only:
            return result if result is not None else CompletionLogprobs()
        return self._logprobs(out, 0, k, offset, result)

    def _response(self, job: Job, finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for prompt_index, final in enumerate(finals):
            echo = job.echo_texts[prompt_index]
            for out in final.outputs:
                logprobs = self._choice_logprobs(job, prompt_index, final.prompt_logprobs, out, len(echo))
                text, finish_reason, stop_reason = echo + out.text, out.finish_reason, out.stop_reason
                if job.echo_only and finish_reason != "error":
                    text, finish_reason, stop_reason = echo, "length", None
                choices.append(CompletionChoice(index=job.choice_index(prompt_index, out.index), text=text,
                                                logprobs=logprobs, finish_reason=finish_reason,
                                                stop_reason=stop_reason))
        usage = self._usage(job, finals, 0 if job.echo_only else None)
        return CompletionResponse(id=job.request_id, model=job.model, choices=choices, usage=usage)

    def _text_choice(self, index: int, text: str) -> CompletionChoice:
        return CompletionChoice(index=index, text=text)

    def _stream_choice(self, job: Job, index: int, state: ChoiceState,
                       out: CompletionOutput) -> CompletionChoice | None:
        prompt_index = index // job.params.n
        echo = job.echo_texts[prompt_index]
        first = not state.started
        if first:
            state.started, state.text_offset = True, len(echo)
        if job.echo_only:  # the prompt alone, in the first chunk; the generated token is dropped
            if not first and out.finish_reason is None:
                return None
            finish_reason = "length" if out.finish_reason != "error" else "error"
            logprobs = None if not first or job.num_logprobs is None else self._prompt_logprobs(
                job.prompts[prompt_index], job.prompt_logprobs.get(prompt_index), job.num_logprobs)
            return CompletionChoice(index=index, text=echo if first else "", logprobs=logprobs,
                                    finish_reason=finish_reason if out.finish_reason is not None else None)
        text = (echo if first else "") + out.text  # `out` is a delta: only what is new
        logprobs = None
        if job.num_logprobs is not None:
            echoed = None if not (first and echo) else self._prompt_logprobs(  # the echo's logprobs lead
                job.prompts[prompt_index], job.prompt_logprobs.get(prompt_index), job.num_logprobs)
            logprobs = self._logprobs(out, 0, job.num_logprobs, state.text_offset, echoed)
            completion_tokens = logprobs.tokens[len(logprobs.tokens) - len(out.token_ids):]
            state.text_offset += sum(len(token) for token in completion_tokens)
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

"""`RequestStream` on the API side: DELTA outputs carry only what is new (text held back while a
stop string may still cut it) and add up to the cumulative outputs of the same deltas."""

from __future__ import annotations

import asyncio

import pytest

from hybridserve.engine import core_messages
from hybridserve.engine.core_client import RequestStream
from hybridserve.models.tokenizer import Tokenizer
from hybridserve.sampling_params import RequestOutput, RequestOutputKind, SamplingParams


def _delta(tokens: list[int], text_start: int, text: str, finish: str | None = None,
           logprobs: bool = False) -> core_messages.RequestDelta:
    rows = [{t: -1.0} for t in tokens] if logprobs else None
    part = core_messages.CompletionDelta(0, tokens, text_start, text, rows, -1.0, finish, None)
    return core_messages.RequestDelta("r", [part], finish is not None, 0, None)


def _read_all(params: SamplingParams, deltas: list[core_messages.RequestDelta],
              tokenizer: Tokenizer | None = None) -> list[RequestOutput]:
    async def run() -> list[RequestOutput]:
        stream = RequestStream("r", [1, 2], params, asyncio.get_running_loop(), 0.0, tokenizer)
        outputs = []
        for delta in deltas:  # one read per delta
            stream.apply(delta)
            outputs.append(await stream.__anext__())
        return outputs
    return asyncio.run(run())


def test_core_text_with_a_stop_string_cut_is_held_back_in_deltas() -> None:
    # the core reports "ab", "abcE", then cuts the stop string "END" it found ("abc")
    deltas = [_delta([1], 0, "ab"), _delta([2], 2, "cE"), _delta([3], 3, "", finish="stop")]
    cumulative = _read_all(SamplingParams(stop=["END"], logprobs=0), deltas)
    assert [o.outputs[0].text for o in cumulative] == ["ab", "abcE", "abc"]
    params = SamplingParams(stop=["END"], output_kind=RequestOutputKind.DELTA)
    pieces = _read_all(params, deltas)
    texts = [o.outputs[0].text for o in pieces]
    assert "".join(texts) == "abc" and texts[0] == ""  # "ab" could begin "END"'s cut: held back
    assert [o.outputs[0].token_ids for o in pieces] == [[1], [2], [3]]
    assert pieces[-1].finished and pieces[-1].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("split", [1, 2, 5])
def test_delta_reads_add_up_to_the_cumulative_output(builtin_tok: Tokenizer, split: int) -> None:
    ids = builtin_tok.encode("héllo wörld ✓ 日本語 plain text")
    chunks = [ids[i:i + split] for i in range(0, len(ids), split)]
    deltas = [_delta(c, 0, "", logprobs=True, finish="length" if i == len(chunks) - 1 else None)
              for i, c in enumerate(chunks)]
    cumulative = _read_all(SamplingParams(logprobs=1), deltas, builtin_tok)[-1].outputs[0]
    pieces = _read_all(SamplingParams(logprobs=1, output_kind=RequestOutputKind.DELTA), deltas, builtin_tok)
    assert cumulative.text == builtin_tok.decode(ids)
    assert "".join(o.outputs[0].text for o in pieces) == cumulative.text
    assert [t for o in pieces for t in o.outputs[0].token_ids] == cumulative.token_ids == ids
    assert [row for o in pieces for row in o.outputs[0].logprobs or []] == cumulative.logprobs
    assert all(len(o.outputs[0].token_ids) == len(c) for o, c in zip(pieces, chunks))

"""`SamplingParams(prompt_logprobs=k)`: every prompt token's logprob and top-k, against
transformers' log-softmax on a tiny checkpoint, with the prefix cache off and on (a warm prefix
present, which such a request must not restore), chunked prefill, batches, `n > 1`, and through
the engine core process; bad values are a `ValueError`."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.engine import request as request_module
from hybridserve.engine.core_client import EngineCoreClient
from hybridserve.sampling_params import MAX_LOGPROBS, RequestOutput, RequestOutputKind
from tests.helpers.checkpoints import reference_text_model
from tests.helpers.live_server import tiny_config
from tests.helpers.targets import CPU

ATOL = 1e-4  # CPU float32 against transformers, as the logits parity tests (tests/README.md)

pytestmark = pytest.mark.timeout(300)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 4096, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(path: Path, **kwargs: object) -> LLM:
    kwargs.setdefault("kv_cache_mib", 16)
    kwargs.setdefault("prefix_cache_mib", 0)
    return LLM(model=str(path), **CPU.engine_kwargs(), **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def reference(text_checkpoint: Path) -> torch.nn.Module:
    """transformers' own model of the checkpoint."""
    return reference_text_model(text_checkpoint)


@torch.no_grad()
def _reference_logprobs(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab]: row i is the log-softmax of the logits after prompt[: i + 1]."""
    return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def assert_prompt_logprobs(rows: list[dict[int, float] | None] | None, prompt: list[int], ref: torch.Tensor,
                           k: int) -> None:
    """vLLM's shape (None, then one dict per prompt token: the token and the top-k) and values
    within ATOL of the reference log-softmax."""
    assert rows is not None and len(rows) == len(prompt) and rows[0] is None
    for position in range(1, len(prompt)):
        row, expected = rows[position], ref[position - 1]
        assert row is not None
        token = prompt[position]
        top = expected.topk(k).indices.tolist() if k else []
        assert set(row) == {token, *top}, (position, row)
        for token_id, value in row.items():
            assert abs(value - expected[token_id].item()) <= ATOL, (position, token_id)


def _close(rows: list[dict[int, float] | None] | None, expected: list[dict[int, float] | None] | None) -> bool:
    """The same tokens in every row, each logprob within ATOL."""
    assert rows is not None and expected is not None and len(rows) == len(expected)
    for row, want in zip(rows, expected):
        if row is None or want is None:
            assert row is want
            continue
        assert row.keys() == want.keys() and all(abs(row[t] - want[t]) <= ATOL for t in row)
    return True


@pytest.mark.parametrize("budget", [4096, 16, 7])
def test_prompt_logprobs_match_transformers_cache_off(text_checkpoint: Path, reference: torch.nn.Module,
                                                      budget: int) -> None:
    llm = _llm(text_checkpoint, max_num_batched_tokens=budget)
    for length, k in ((77, 5), (9, 0), (40, MAX_LOGPROBS)):
        prompt = _prompt(length, seed=length)
        out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=k))[0]
        assert_prompt_logprobs(out.prompt_logprobs, prompt, _reference_logprobs(reference, prompt), k)
        assert out.outputs[0].logprobs is None  # prompt logprobs alone do not turn on the completion's
    llm.llm_engine.check_integrity()


@pytest.mark.parametrize("fixture", ["tied_text_checkpoint", "multimodal_checkpoint"])
def test_prompt_logprobs_on_the_other_checkpoints(fixture: str, request: pytest.FixtureRequest) -> None:
    """Tied embeddings, and the multimodal layout's language model, against their own reference."""
    path: Path = request.getfixturevalue(fixture)
    prompt = _prompt(50, seed=11)
    out = _llm(path, prefix_cache_mib=16, max_num_batched_tokens=16).generate(
        [prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3))[0]
    assert_prompt_logprobs(out.prompt_logprobs, prompt, _reference_logprobs(reference_text_model(path), prompt), 3)


@pytest.mark.parametrize("budget", [4096, 16])
def test_prompt_logprobs_bypass_a_warm_prefix(text_checkpoint: Path, reference: torch.nn.Module,
                                              budget: int) -> None:
    """With the prefix cache on and the prompt's prefix cached, a prompt-logprobs request computes
    the whole prompt (nothing restored) and matches the reference; the cache still serves plain
    requests afterwards, with the same greedy tokens as a cold run."""
    llm = _llm(text_checkpoint, prefix_cache_mib=16, max_num_batched_tokens=budget)
    prompt = _prompt(150, seed=3)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cold = llm.generate([prompt], greedy)[0]
    warm = llm.generate([prompt], greedy)[0]
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens > 0  # the prefix is cached
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    hits = llm.prefix_cache_stats().hits
    scored = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                   prompt_logprobs=2))[0]
    assert scored.num_cached_tokens == 0 and llm.prefix_cache_stats().hits == hits
    assert_prompt_logprobs(scored.prompt_logprobs, prompt, _reference_logprobs(reference, prompt), 2)
    assert scored.outputs[0].token_ids == cold.outputs[0].token_ids
    llm.llm_engine.check_integrity()
    again = llm.generate([prompt], greedy)[0]  # what the scored request published is sound
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == cold.outputs[0].token_ids
    extended = prompt + _prompt(20, seed=4)  # a longer prompt that shares the cached prefix
    ext = llm.generate([extended], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))[0]
    assert ext.num_cached_tokens == 0
    assert_prompt_logprobs(ext.prompt_logprobs, extended, _reference_logprobs(reference, extended), 1)
    llm.llm_engine.check_integrity()


def test_prompt_logprobs_in_a_mixed_batch(text_checkpoint: Path, reference: torch.nn.Module) -> None:
    """Requests with and without prompt logprobs prefilled and decoded together (chunk boundaries
    anywhere, a one-token chunk included), `n > 1`, and a one-token prompt."""
    llm = _llm(text_checkpoint, prefix_cache_mib=16, max_num_batched_tokens=23)
    prompts = [_prompt(n, seed=100 + n) for n in (1, 2, 30, 64, 65, 90)]
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                             prompt_logprobs=None if i % 3 == 2 else i % 4, n=2 if i == 3 else 1)
              for i in range(len(prompts))]
    outputs = llm.generate(prompts, params)
    for prompt, param, out in zip(prompts, params, outputs):
        if param.prompt_logprobs is None:  # unaffected by its batch-mates: what it generates alone
            alone = _llm(text_checkpoint).generate([prompt], param)[0]
            assert out.prompt_logprobs is None and out.outputs[0].token_ids == alone.outputs[0].token_ids
            continue
        assert_prompt_logprobs(out.prompt_logprobs, prompt, _reference_logprobs(reference, prompt),
                               param.prompt_logprobs)
        assert len(out.outputs) == param.n and all(len(c.token_ids) == 4 for c in out.outputs)
    assert outputs[0].prompt_logprobs == [None]
    llm.llm_engine.check_integrity()


def test_prompt_logprobs_survive_preemptions(text_checkpoint: Path, reference: torch.nn.Module) -> None:
    """A KV pool too small for every request at once: preempted requests recompute, and each
    prompt token is scored once."""
    llm = _llm(text_checkpoint, kv_cache_mib=30 * 16 * 256 / 2**20, max_num_batched_tokens=32, max_num_seqs=4)
    engine = llm.llm_engine
    assert engine.num_kv_blocks == 30  # 16 tokens of 256 bytes (one attention layer) per block
    prompts = [_prompt(100, seed=200 + i) for i in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    outputs = llm.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0, "the scenario did not preempt"
    for prompt, out in zip(prompts, outputs):
        assert_prompt_logprobs(out.prompt_logprobs, prompt, _reference_logprobs(reference, prompt), 1)
    engine.check_integrity()


def test_prompt_logprobs_after_a_preemption_mid_prefill(text_checkpoint: Path, reference: torch.nn.Module) -> None:
    """Preempted halfway through its chunked prefill, with the prefix cache on (its first chunks'
    blocks are cached by then): the request recomputes its prompt and scores each token once."""
    llm = _llm(text_checkpoint, prefix_cache_mib=16, max_num_batched_tokens=16)
    engine = llm.llm_engine
    prompt = _prompt(100, seed=300)
    engine.add_request("mid", prompt, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=4))
    request = engine.requests["mid"].first
    while request.num_computed_tokens < 48:
        engine.step()
    assert request.prompt_logprobs is not None and len(request.prompt_logprobs) == 49
    engine.scheduler._preempt(request)
    finished = None
    while engine.has_unfinished_requests():
        finished = next((o for o in engine.step() if o.finished), finished)
    assert finished is not None and finished.num_cached_tokens == 0
    assert_prompt_logprobs(finished.prompt_logprobs, prompt, _reference_logprobs(reference, prompt), 4)
    engine.check_integrity()


def test_prompt_logprobs_chunks_are_capped(text_checkpoint: Path, reference: torch.nn.Module,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt-logprobs request's prefill chunks hold at most PROMPT_LOGPROBS_CHUNK_TOKENS tokens
    (its kept logits stay bounded whatever the step budget); a plain request's are not capped."""
    monkeypatch.setattr(request_module, "PROMPT_LOGPROBS_CHUNK_TOKENS", 10)
    llm = _llm(text_checkpoint, max_num_batched_tokens=4096)
    engine = llm.llm_engine
    prompt = _prompt(77, seed=12)
    for request_id, params, steps in (("plain", SamplingParams(max_tokens=1), 1),
                                      ("scored", SamplingParams(max_tokens=1, prompt_logprobs=1), 8)):
        engine.add_request(request_id, prompt, params)
        outputs: list[RequestOutput] = []
        while not outputs:
            outputs = engine.step()
            steps -= 1
        assert steps == 0, request_id  # 77 tokens: one step, or ceil(77 / 10) steps
    assert_prompt_logprobs(outputs[0].prompt_logprobs, prompt, _reference_logprobs(reference, prompt), 1)
    engine.check_integrity()


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, 1000])
def test_bad_prompt_logprobs(value: int) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


@pytest.mark.parametrize("value", ["3", 2.0, True])
def test_prompt_logprobs_of_the_wrong_type(value: object) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]


def test_prompt_logprobs_through_the_core_process(text_checkpoint: Path) -> None:
    """The engine core process sends them once, in the first delta: a cumulative stream yields them
    in every output, a DELTA stream in its first only; equal to `LLM.generate`'s."""
    prompt = _prompt(60, seed=9)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=3, logprobs=1)
    expected = _llm(text_checkpoint, prefix_cache_mib=16).generate([prompt], params)[0].prompt_logprobs
    client = EngineCoreClient(dataclasses.replace(tiny_config(), model=str(text_checkpoint)))
    client.start()
    try:
        async def run(kind: RequestOutputKind, request_id: str) -> list[RequestOutput]:
            wanted = dataclasses.replace(params, output_kind=kind)
            return [out async for out in client.generate(request_id, prompt, wanted)]

        cumulative = asyncio.run(run(RequestOutputKind.CUMULATIVE, "cumulative"))
        deltas = asyncio.run(run(RequestOutputKind.DELTA, "delta"))
        asyncio.run(client.check_integrity())
    finally:
        client.shutdown()
    assert all(_close(out.prompt_logprobs, expected) for out in cumulative)
    assert _close(deltas[0].prompt_logprobs, expected) and all(out.prompt_logprobs is None for out in deltas[1:])
    assert cumulative[-1].num_cached_tokens == 0

"""Structured outputs: the llguidance grammar compiler and the batched token mask, alone and in
the engine (with n, the prefix cache and the Python API)."""

from __future__ import annotations

import json

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.engine.structured_output import GrammarCompiler, TokenMasker
from hybridserve.models.builtin import builtin_tokenizer
from hybridserve.sampling_params import StructuredOutputsParams

VOCAB = 4096
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "tag": {"type": "string", "maxLength": 6}},
         "required": ["x", "tag"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return builtin_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_mib=16, prefix_cache_mib=32, snapshot_interval=64)


def _run_masked(matchers, masker: TokenMasker, steps: int, seed: int = 0) -> list[list[int]]:
    """Sample random logits through the mask for every matcher (one batch per step)."""
    generator = torch.Generator().manual_seed(seed)
    outputs: list[list[int]] = [[] for _ in matchers]
    for _ in range(steps):
        live = [i for i, m in enumerate(matchers) if not m.is_stopped()]
        if not live:
            break
        logits = torch.randn(len(live), VOCAB, generator=generator)
        masker.apply(logits, list(range(len(live))), [matchers[i] for i in live])
        tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(1).tolist()
        for row, token in zip(live, tokens):
            assert matchers[row].consume_token(token), matchers[row].get_error()
            outputs[row].append(token)
    return outputs


def test_batched_mask_with_different_grammars_per_row(compiler: GrammarCompiler, tokenizer) -> None:
    masker = TokenMasker(VOCAB)
    specs = [StructuredOutputsParams(json=POINT), StructuredOutputsParams(regex="[0-9]{3}-[a-z]{2}"),
             StructuredOutputsParams(choice=["alpha", "beta", "gamma"]), StructuredOutputsParams(json_object=True)]
    matchers = [compiler.matcher(spec) for spec in specs]
    outputs = _run_masked(matchers, masker, steps=200)
    eos = set(tokenizer.eos_token_ids)
    texts = [tokenizer.decode([t for t in out if t not in eos]) for out in outputs]
    point = json.loads(texts[0])
    assert set(point) == {"x", "tag"} and 0 <= point["x"] <= 99 and len(point["tag"]) <= 6
    assert len(texts[1]) == 6 and texts[1][:3].isdigit() and texts[1][3] == "-" and texts[1][4:].isalpha()
    assert texts[2] in ("alpha", "beta", "gamma")
    assert matchers[0].is_stopped() and matchers[1].is_stopped() and matchers[2].is_stopped()


def test_mask_rows_are_independent_of_their_neighbours(compiler: GrammarCompiler) -> None:
    masker = TokenMasker(VOCAB)
    digits, letters = compiler.matcher(StructuredOutputsParams(regex="[0-9]+")), \
        compiler.matcher(StructuredOutputsParams(regex="[a-z]+"))
    allowed = masker.allowed([digits, letters])
    alone = masker.allowed([compiler.matcher(StructuredOutputsParams(regex="[a-z]+"))])
    assert torch.equal(allowed[1], alone[0])
    assert not (allowed[0] & allowed[1]).any()  # a token is a digit run or a letter run, never both
    logits = torch.zeros(3, VOCAB)
    masker.apply(logits, [0, 2], [digits, letters])
    assert torch.isinf(logits[0]).sum() == VOCAB - int(allowed[0].sum())
    assert not torch.isinf(logits[1]).any()  # an unconstrained row is untouched


def test_grammar_forbids_eos_until_complete(compiler: GrammarCompiler, tokenizer) -> None:
    masker = TokenMasker(VOCAB)
    matcher = compiler.matcher(StructuredOutputsParams(json=POINT))
    for token in tokenizer.encode('{"x": 5, "tag": "ab'):
        assert not masker.allowed([matcher])[0, list(tokenizer.eos_token_ids)].any()
        assert matcher.consume_token(token)
    for token in tokenizer.encode('"}'):
        assert matcher.consume_token(token)
    assert masker.allowed([matcher])[0, list(tokenizer.eos_token_ids)].all()
    assert not masker.allowed([matcher])[0, tokenizer.encode("x")].any()


def test_compile_cache_and_bad_grammars(compiler: GrammarCompiler) -> None:
    before = compiler.cache_info()
    schema = {"type": "object", "properties": {"unique_field_for_cache_test": {"type": "boolean"}}}
    compiler.matcher(StructuredOutputsParams(json=schema))
    compiler.matcher(StructuredOutputsParams(json=json.dumps(schema)))  # same schema as text: same key
    after = compiler.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)
    with pytest.raises(ValueError, match="invalid structured output"):
        compiler.matcher(StructuredOutputsParams(grammar="start: ???"))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=schema, regex="a")
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")


def test_engine_structured_outputs_with_n_and_prefix_cache(llm: LLM) -> None:
    prefix = "Give a point as JSON. " * 12
    params = SamplingParams(n=3, max_tokens=40, temperature=1.0, seed=5,
                            structured_outputs=StructuredOutputsParams(json=POINT))
    cold = llm.generate([prefix + "first"], params)[0]
    warm = llm.generate([prefix + "second"], params)[0]
    assert warm.num_cached_tokens > 0
    for output in [*cold.outputs, *warm.outputs]:
        point = json.loads(output.text)
        assert output.finish_reason == "stop" and 0 <= point["x"] <= 99
    choice = llm.generate(["Pick"], SamplingParams(max_tokens=8, temperature=0.8, seed=1,
                                                   structured_outputs={"choice": ["yes", "no"]}))[0]
    assert choice.outputs[0].text in ("yes", "no")
    llm.llm_engine.check_integrity()


def test_unconstrained_rows_share_a_batch_with_constrained_ones(llm: LLM) -> None:
    free = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = llm.generate(["Batch neighbour"], free)[0].outputs[0].token_ids
    mixed = llm.generate(["Batch neighbour", "Constrained"],
                         [free, SamplingParams(max_tokens=6, structured_outputs={"regex": "[0-9]{6}"})])
    assert mixed[0].outputs[0].token_ids == alone
    assert mixed[1].outputs[0].text.isdigit()

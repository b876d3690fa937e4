"""Engine core: chunked prefill, continuous batching, stop conditions, bad input, pool accounting."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.engine.engine import LLMEngine
from tests.helpers.targets import CPU


def _random_prompt(length: int, seed: int, vocab: int = 4096) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(path: Path, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_mib", 16)
    kwargs.setdefault("prefix_cache_mib", 0)
    kwargs.setdefault("device", CPU.device)
    kwargs.setdefault("dtype", CPU.dtype)
    return LLM(model=str(path), **kwargs)


def _assert_idle(llm: LLM) -> None:
    llm.llm_engine.check_integrity()
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("budget", [7, 16, 64, 100])
def test_chunked_prefill_matches_single_pass(text_checkpoint: Path, budget: int) -> None:
    prompt = _random_prompt(230, seed=1)
    single = _llm(text_checkpoint, max_num_batched_tokens=4096)
    chunked = _llm(text_checkpoint, max_num_batched_tokens=budget)
    ref_logits = single.llm_engine.prompt_logits(prompt)
    logits = chunked.llm_engine.prompt_logits(prompt)
    assert logits.shape == ref_logits.shape == (230, 4096)
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    a, b = single.generate([prompt], params)[0].outputs[0], chunked.generate([prompt], params)[0].outputs[0]
    assert a.token_ids == b.token_ids
    for la, lb in zip(a.logprobs, b.logprobs):
        assert la.keys() == lb.keys()
        assert max(abs(la[t] - lb[t]) for t in la) <= 1e-4
    _assert_idle(single)
    _assert_idle(chunked)


def test_batched_decode_matches_each_alone(text_checkpoint: Path) -> None:
    prompts = [_random_prompt(n, seed=n) for n in (3, 17, 40, 64, 65, 100, 129, 200)]
    params = [SamplingParams(max_tokens=10 + 3 * i, temperature=0.0, ignore_eos=True, logprobs=2)
              for i in range(len(prompts))]
    llm = _llm(text_checkpoint, max_num_batched_tokens=96)
    together = llm.generate(prompts, params)
    for prompt, param, request_output in zip(prompts, params, together):
        out = request_output.outputs[0]
        alone = llm.generate([prompt], param)[0].outputs[0]
        assert out.token_ids == alone.token_ids
        assert len(out.token_ids) == param.max_tokens and out.finish_reason == "length"
        for la, lb in zip(out.logprobs, alone.logprobs):
            assert max(abs(la[t] - lb[t]) for t in la) <= 1e-4
    _assert_idle(llm)


def test_requests_join_while_others_decode(text_checkpoint: Path) -> None:
    llm = _llm(text_checkpoint)
    engine = llm.llm_engine
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine.add_request("first", _random_prompt(30, seed=5), greedy)
    for _ in range(5):
        engine.step()
    engine.add_request("second", _random_prompt(50, seed=6), greedy)
    finished = {}
    steps_with_both = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps_with_both += len(outputs) == 2
        finished.update({o.request_id: o for o in outputs if o.finished})
    assert steps_with_both > 0
    alone = llm.generate([_random_prompt(50, seed=6)], greedy)[0].outputs[0]
    assert finished["second"].outputs[0].token_ids == alone.token_ids
    _assert_idle(llm)


def test_final_only_steps_return_just_the_finished_outputs(text_checkpoint: Path) -> None:
    """`step(final_only=True)` (what LLM.generate uses) returns an output only when its request
    ends, equal to what `step()` returns then."""
    prompts = {"short": _random_prompt(20, seed=7), "long": _random_prompt(25, seed=8)}
    lengths = {"short": 3, "long": 9}
    results = {}
    for final_only in (False, True):
        llm = _llm(text_checkpoint)
        engine = llm.llm_engine
        for request_id, prompt in prompts.items():
            engine.add_request(request_id, prompt,
                               SamplingParams(max_tokens=lengths[request_id], temperature=0.0, ignore_eos=True))
        seen, finished = [], {}
        while engine.has_unfinished_requests():
            outputs = engine.step(final_only=final_only)
            seen.append(len(outputs))
            finished.update({o.request_id: o for o in outputs if o.finished})
        assert sorted(finished) == ["long", "short"]
        assert sum(seen) == (2 if final_only else lengths["short"] + lengths["long"])
        results[final_only] = {k: (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
                               for k, o in finished.items()}
        _assert_idle(llm)
    assert results[True] == results[False]


def test_seeded_sampling_is_reproducible(text_checkpoint: Path) -> None:
    llm = _llm(text_checkpoint)
    prompt = _random_prompt(20, seed=9)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=42, ignore_eos=True)
    a = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    b = llm.generate([prompt, prompt], [seeded, seeded])
    assert a == b[0].outputs[0].token_ids == b[1].outputs[0].token_ids
    other = SamplingParams(max_tokens=16, temperature=1.0, seed=43, ignore_eos=True)
    assert llm.generate([prompt], other)[0].outputs[0].token_ids != a
    _assert_idle(llm)


def test_stop_strings_eos_and_stop_tokens() -> None:
    llm = LLM(**CPU.engine_kwargs(), kv_cache_mib=16, prefix_cache_mib=0)
    base = llm.generate(["The engine"], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert len(base.token_ids) == 24
    stop_token = base.token_ids[5]
    params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_token])
    out = llm.generate(["The engine"], params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop_token) + 1]
    stop_text = base.text[6:9]
    if stop_text:
        params = SamplingParams(max_tokens=24, temperature=0.0, stop=[stop_text])
        out = llm.generate(["The engine"], params)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop_text
        assert out.text == base.text[: base.text.index(stop_text)]
    eos = llm.tokenizer.eos_token_ids[0]
    forced = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=[],
                                                      ignore_eos=False, logprobs=1))[0].outputs[0]
    assert forced.finish_reason in ("stop", "length")
    assert eos not in forced.token_ids[:-1]
    _assert_idle(llm)


def test_abort_frees_everything(text_checkpoint: Path) -> None:
    llm = _llm(text_checkpoint)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    engine.add_request("a", _random_prompt(90, seed=1), params)
    engine.add_request("b", _random_prompt(40, seed=2), params)
    engine.add_request("c", _random_prompt(40, seed=3), params)
    engine.step()
    engine.abort_request("a")
    engine.abort_request("c")
    engine.abort_request("unknown")
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    _assert_idle(llm)


def test_preemption_under_a_tiny_kv_pool(text_checkpoint: Path) -> None:
    """A pool too small for all requests: some are preempted and recomputed; output unchanged."""
    prompts = [_random_prompt(60, seed=s) for s in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = _llm(text_checkpoint).generate(prompts, params)
    # 1 attention layer * 2 kv heads * 16 dims * 4 bytes * 2 (k, v) = 256 B/token -> 4 KiB per block;
    # 16 blocks admit four 60-token prompts, whose decodes then run out of blocks.
    tight = _llm(text_checkpoint, kv_cache_mib=16 * 4 / 1024)
    assert tight.llm_engine.num_kv_blocks == 16
    outs = tight.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
    assert tight.llm_engine.scheduler.num_preemptions > 0
    _assert_idle(tight)


BAD_INPUTS = [
    ("", SamplingParams(), "empty"),
    ([], SamplingParams(), "non-empty"),
    ([1, 2, 4096], SamplingParams(), "outside the vocabulary"),
    ([1, -1], SamplingParams(), "outside the vocabulary"),
    ([1, "x"], SamplingParams(), "outside the vocabulary"),
    (list(range(600)), SamplingParams(), "maximum context length"),
    ([1] * 500, SamplingParams(max_tokens=100), "maximum context length"),
]


@pytest.mark.parametrize("prompt,params,message", BAD_INPUTS)
def test_bad_input_is_a_clear_value_error(text_checkpoint: Path, prompt, params, message: str) -> None:
    llm = _llm(text_checkpoint, max_model_len=512)
    engine: LLMEngine = llm.llm_engine
    engine.add_request("good", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    with pytest.raises(ValueError, match=message):
        llm.generate([[5, 6], prompt], params)  # validated before anything runs
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    _assert_idle(llm)


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(logprobs=-1), "logprobs"),
])
def test_bad_sampling_params(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_sampling_field_and_duplicate_id(text_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"max_tokens": 4, "temprature": 0.5})
    with pytest.raises(ValueError, match="unknown sampling parameter.*temprature"):
        SamplingParams(temprature=0.5)  # type: ignore[call-arg]
    llm = _llm(text_checkpoint)
    engine = llm.llm_engine
    engine.add_request("x", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [1, 2], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    _assert_idle(llm)


@pytest.mark.parametrize("kwargs,message", [
    (dict(snapshot_interval=100), "multiple of"),
    (dict(prefix_cache_mib=0.0001), "smaller than one GDN snapshot"),
    (dict(kv_cache_mib=-1), "kv_cache_mib"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(dtype="int8"), "dtype"),
])
def test_bad_engine_config(text_checkpoint: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(model=str(text_checkpoint), **{**CPU.engine_kwargs(), **kwargs})


def test_builtin_model_generates_and_cli_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from hybridserve.cli import main

    assert main(["generate", *CPU.cli_args(), "--prompt", "Hello", "--max-tokens", "4", "--kv-cache-mib", "8",
                 "--prefix-cache-mib", "0", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("Hello")
    assert "completion_tokens=4" in captured.err
    assert main(["generate", *CPU.cli_args(), "--max-tokens", "0"]) == 2


def _record_step_tokens(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """A list that fills with (decode tokens, prefill tokens) for every step the engine schedules."""
    seen: list[tuple[int, int]] = []
    original = engine.scheduler.schedule

    def recording():
        out = original()
        decode = sum(c.length for c in out.chunks if c.request.num_tokens - c.start == 1)
        seen.append((decode, sum(c.length for c in out.chunks) - decode))
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", recording)
    return seen


def test_prefill_is_capped_while_others_decode(text_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = _llm(text_checkpoint, max_prefill_tokens_during_decode=32)
    engine = llm.llm_engine
    seen = _record_step_tokens(engine, monkeypatch)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request("decoder", _random_prompt(20, seed=1), greedy)
    engine.step()
    engine.step()
    engine.add_request("long", _random_prompt(300, seed=2), greedy)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert all(prefill <= 32 for decode, prefill in seen if decode)
    assert any(decode and prefill == 32 for decode, prefill in seen)
    alone = _llm(text_checkpoint).generate([_random_prompt(300, seed=2)], greedy)[0].outputs[0]
    assert outputs["long"].outputs[0].token_ids == alone.token_ids
    _assert_idle(llm)


def test_burst_of_new_requests_joins_a_decoding_batch_in_one_step(text_checkpoint: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap is per request owed prompt tokens: four short prompts arriving while one request
    decodes all start in the next step, and a lone long prompt still gets 32 tokens a step."""
    llm = _llm(text_checkpoint, max_prefill_tokens_during_decode=32)
    engine = llm.llm_engine
    seen = _record_step_tokens(engine, monkeypatch)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("decoder", _random_prompt(20, seed=1), greedy)
    engine.step()
    for i in range(4):
        engine.add_request(f"burst-{i}", _random_prompt(24, seed=10 + i), greedy)
    engine.step()
    assert seen[-1] == (1, 4 * 24)
    engine.add_request("long", _random_prompt(200, seed=2), greedy)
    engine.step()
    assert seen[-1] == (5, 32)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    alone = _llm(text_checkpoint).generate([_random_prompt(24, seed=10)], greedy)[0].outputs[0]
    assert outputs["burst-0"].outputs[0].token_ids == alone.token_ids
    _assert_idle(llm)


def test_bfloat16_path_runs_and_tracks_float32(text_checkpoint: Path) -> None:
    """The accelerator dtype path (bf16 weights and KV, float32 GDN state) works end to end."""
    prompt = _random_prompt(100, seed=11)
    fp32 = _llm(text_checkpoint)
    bf16 = _llm(text_checkpoint, dtype="bfloat16")
    assert bf16.llm_engine.dtype == torch.bfloat16
    assert bf16.llm_engine.runner.live_states.recurrent.dtype == torch.float32
    ref, low = fp32.llm_engine.prompt_logits(prompt), bf16.llm_engine.prompt_logits(prompt)
    assert torch.corrcoef(torch.stack([ref.flatten(), low.flatten()]))[0, 1] > 0.99
    out = bf16.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 8
    _assert_idle(bf16)


def test_a_burst_that_outnumbers_the_decoders_is_prefilled_whole(text_checkpoint: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Six prompts arriving while two requests decode exceed the cap (6 x 32 tokens) but outnumber
    the decoders: the next step takes them whole; once they decode, a lone long prompt is capped."""
    llm = _llm(text_checkpoint, max_prefill_tokens_during_decode=32)
    engine = llm.llm_engine
    seen = _record_step_tokens(engine, monkeypatch)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"decoder-{i}", _random_prompt(20, seed=1 + i), greedy)
    engine.step()
    for i in range(6):
        engine.add_request(f"burst-{i}", _random_prompt(64, seed=10 + i), greedy)
    engine.step()
    assert seen[-1] == (2, 6 * 64)
    engine.add_request("long", _random_prompt(200, seed=2), greedy)
    engine.step()
    assert seen[-1] == (8, 32)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    alone = _llm(text_checkpoint).generate([_random_prompt(64, seed=13)], greedy)[0].outputs[0]
    assert outputs["burst-3"].outputs[0].token_ids == alone.token_ids
    _assert_idle(llm)

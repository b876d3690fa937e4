"""The vLLM-shaped Python API: RequestOutput/CompletionOutput, n completions forked from one
prefill, LLM.chat, get_tokenizer, max_tokens=None, progress bar, type errors."""

from __future__ import annotations

import pytest

from hybridserve import LLM, CompletionOutput, RequestOutput, SamplingParams

PROMPT = "The joint prefix cache keeps KV blocks and GDN snapshots together"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_mib=16, prefix_cache_mib=0, max_model_len=256)


def _idle(llm: LLM) -> None:
    llm.llm_engine.check_integrity()
    assert not llm.llm_engine.has_unfinished_requests()


def test_output_shape(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(max_tokens=5, temperature=0.0, logprobs=2))[0]
    assert isinstance(out, RequestOutput) and out.finished and out.prompt == PROMPT
    assert out.prompt_token_ids == llm.get_tokenizer().encode(PROMPT)
    completion = out.outputs[0]
    assert isinstance(completion, CompletionOutput) and completion.index == 0
    assert len(completion.token_ids) == 5 and completion.finish_reason == "length"
    assert completion.text == llm.get_tokenizer().decode(completion.token_ids)
    expected = sum(step[token] for step, token in zip(completion.logprobs, completion.token_ids))
    assert completion.cumulative_logprob == pytest.approx(expected)
    assert "arrival_time" in out.metrics and "first_token_time" in out.metrics


def test_n_completions_share_one_prefill(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = llm.llm_engine
    computed: list[int] = []
    execute = engine.executor.execute

    def counting(plan):  # noqa: ANN001, ANN202 - wraps Executor.execute
        computed.append(sum(chunk.length for chunk in plan.chunks))
        return execute(plan)

    monkeypatch.setattr(engine.executor, "execute", counting)
    prompt_len = len(llm.get_tokenizer().encode(PROMPT))
    out = llm.generate(PROMPT, SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert sum(computed) == prompt_len + 4 * (6 - 1)  # the prompt once, then one token per step each
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    _idle(llm)


def test_forked_completions_match_separate_requests(llm: LLM) -> None:
    greedy = llm.generate(PROMPT, SamplingParams(n=3, max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    single = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert all(c.token_ids == single.outputs[0].token_ids for c in greedy.outputs)
    # completion i of a seeded request samples like a single request seeded with seed + i
    forked = llm.generate(PROMPT, SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=11, ignore_eos=True))[0]
    second = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=1.0, seed=12, ignore_eos=True))[0]
    assert forked.outputs[1].token_ids == second.outputs[0].token_ids
    _idle(llm)


def test_forks_survive_preemption() -> None:
    params = SamplingParams(n=3, max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = LLM(kv_cache_mib=16, prefix_cache_mib=0).generate([PROMPT, "Another prompt"], params)
    tight_llm = LLM(kv_cache_mib=0.25, prefix_cache_mib=0)  # 8 blocks of 16 tokens
    tight = tight_llm.generate([PROMPT, "Another prompt"], params)
    assert [[c.token_ids for c in o.outputs] for o in tight] == [[c.token_ids for c in o.outputs] for o in roomy]
    assert tight_llm.llm_engine.scheduler.num_preemptions > 0
    _idle(tight_llm)


def test_abort_of_a_forked_request_frees_everything(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("to-abort", PROMPT, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.num_running_requests == 3
    engine.abort_request("to-abort")
    _idle(llm)


def test_max_tokens_none_runs_to_the_context() -> None:
    short = LLM(kv_cache_mib=4, prefix_cache_mib=0, max_model_len=40)
    out = short.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 40 - 4 and out.outputs[0].finish_reason == "length"


def test_chat_and_tokenizer(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.tokenizer and tokenizer.decode(tokenizer.encode("round trip")) == "round trip"
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    one = llm.chat(conversation, params)
    both = llm.chat([conversation, [{"role": "user", "content": "Other"}]], params)
    assert len(one) == 1 and len(both) == 2 and one[0].outputs[0].text == both[0].outputs[0].text
    thinking = llm.render_chat(conversation)
    plain = llm.render_chat(conversation, chat_template_kwargs={"enable_thinking": False})
    assert thinking.endswith("<think>\n") and plain.endswith("<think>\n\n</think>\n\n")
    assert one[0].prompt == thinking
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    assert '"name": "lookup"' in llm.render_chat(conversation, tools=tools)
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "no role"}])


def test_progress_bar(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    llm.generate(["a b", "c d"], SamplingParams(max_tokens=2))
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate(["a b", "c d"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": "0.5"}, "temperature must be a number, got str"),
    ({"max_tokens": 2.0}, "max_tokens must be an integer or None, got float"),
    ({"n": "2"}, "n must be an integer, got str"),
    ({"ignore_eos": 1}, "ignore_eos must be a bool, got int"),
    ({"stop": 5}, "stop must be a string or a list of strings, got int"),
    ({"structured_outputs": "json"}, "structured_outputs must be a StructuredOutputsParams or a dict, got str"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias must be a dict of token id"),
])
def test_type_errors_name_the_type(kwargs: dict, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=message):  # also a ValueError, the API's error for bad input
        SamplingParams(**kwargs)


def test_bad_api_arguments(llm: LLM) -> None:
    with pytest.raises(ValueError, match="n must be in"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"stream_interval must be in \[1, 65536\]"):
        SamplingParams(stream_interval=0)
    with pytest.raises(ValueError, match="stream_interval must be an integer, got str"):
        SamplingParams(stream_interval="4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="list of them, got dict"):
        llm.generate("x", {"max_tokens": 3})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="got int"):
        llm.generate(5)  # type: ignore[arg-type]
    _idle(llm)


def test_logit_bias(llm: LLM) -> None:
    favourite = 4000
    out = llm.generate("Bias me", SamplingParams(max_tokens=3, temperature=1.0, seed=0,
                                                 logit_bias={favourite: 100.0}))[0]
    assert out.outputs[0].token_ids == [favourite] * 3
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate("x", SamplingParams(logit_bias={10**6: 1.0}))


def test_start_up_builds_the_kernels_before_the_first_request() -> None:
    """`LLM()` (and so the server's readiness) returns with the CPU kernels loaded: the first request
    must not pay for compiling them."""
    from hybridserve.layers import native

    if not native.native_kernels_enabled():
        pytest.skip("the C kernels are switched off or cannot be built here")
    native._library.cache_clear()
    LLM(kv_cache_mib=4, prefix_cache_mib=0)
    assert native._library.cache_info().currsize == 1

"""Grammar compilation off the step loop (issue 36, item 3): a request waits for its own grammar
while the rest of the batch keeps stepping, a compile past its timeout ends only that request, an
abandoned compile leaks nothing, and the compiled-grammar cache stays bounded. Slowness comes from
a compile test double (`GrammarCompiler(build=...)`) held on an event: steps are counted, no
wall-clock threshold is asserted."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import llguidance
import pytest

from hybridserve import LLM, SamplingParams, envs
from hybridserve.engine.async_engine import AsyncLLMEngine
from hybridserve.engine.engine import LLMEngine
from hybridserve.engine.structured_output import GrammarCompiler, GrammarTimeoutError
from hybridserve.models.builtin import builtin_tokenizer
from hybridserve.sampling_params import StructuredOutputsParams
from tests.helpers.live_server import tiny_config, wait_until

VOCAB = 4096
DIGITS = StructuredOutputsParams(regex="[0-9]{6}")
FREE = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
CONSTRAINED = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=DIGITS)


class GatedBuild:
    """A compile that waits for `gate` before doing the real one (only for the grammars in `held`
    when given), recording the grammars it built."""

    def __init__(self, held: set[str] | None = None) -> None:
        self.held = held
        self.gate = threading.Event()
        self.started = threading.Event()
        self.built: list[str] = []
        self.compiler: GrammarCompiler | None = None

    def __call__(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        if self.held is None or spec.key in self.held:
            self.started.set()
            self.gate.wait(60)
        assert self.compiler is not None
        self.built.append(spec.key)
        return self.compiler._compile(spec)


def gated_compiler(timeout_s: float = 60.0, workers: int = 2, cache_size: int = 8,
                   held: set[str] | None = None) -> tuple[GrammarCompiler, GatedBuild]:
    build = GatedBuild(held)
    compiler = GrammarCompiler(builtin_tokenizer(), VOCAB, cache_size, workers=workers, timeout_s=timeout_s,
                               build=build)
    build.compiler = compiler
    return compiler, build


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_mib=16, prefix_cache_mib=32, snapshot_interval=64)


@pytest.fixture
def engine(llm: LLM) -> Iterator[LLMEngine]:
    engine = llm.llm_engine
    original = engine.grammars
    yield engine
    engine.grammars = original
    engine.check_integrity()
    assert not engine.has_unfinished_requests() and engine.num_waiting_requests == 0


def step_until(engine: LLMEngine, done: object, limit: int = 10_000) -> int:
    """Step until `done()` holds; the number of steps it took."""
    for count in range(limit):
        if done():  # type: ignore[operator]
            return count
        engine.step()
    raise AssertionError("condition not reached")


def test_a_compiling_grammar_does_not_stall_the_batch(engine: LLMEngine) -> None:
    compiler, build = gated_compiler()
    engine.grammars = compiler
    try:
        engine.add_request("free", "Batch neighbour", FREE)
        engine.add_request("slow", "Constrained", CONSTRAINED)
        free, slow = engine.requests["free"].first, engine.requests["slow"].first
        assert engine.awaits_grammar("slow") and engine.num_waiting_requests == 2
        steps = step_until(engine, lambda: free.is_finished)
        assert steps >= FREE.max_tokens and len(free.output_token_ids) == FREE.max_tokens
        assert engine.awaits_grammar("slow") and not slow.output_token_ids  # it waited, the batch did not
        assert engine.num_waiting_requests == 1 and engine.has_unfinished_requests()
        build.gate.set()
        step_until(engine, lambda: slow.is_finished)
        assert slow.finish_reason == "stop" and slow.output_text.isdigit() and len(slow.output_text) == 6
        assert compiler.cache_info().compiling == 0 and build.built == [DIGITS.key]
    finally:
        build.gate.set()
        compiler.close()


def test_a_grammar_past_its_timeout_ends_only_its_request(engine: LLMEngine) -> None:
    compiler, build = gated_compiler(timeout_s=0.05)
    engine.grammars = compiler
    try:
        engine.add_request("neighbour", "Batch neighbour", SamplingParams(max_tokens=2000, temperature=0.0,
                                                                          ignore_eos=True))
        engine.add_request("late", "Constrained", CONSTRAINED)
        neighbour, late = engine.requests["neighbour"].first, engine.requests["late"].first
        finished: list[str] = []
        for _ in range(10_000):
            finished += [out.request_id for out in engine.step() if out.finished]
            if late.is_finished:
                break
        assert late.is_finished and late.finish_reason == "error" and not late.output_token_ids
        assert "late" in finished and "late" not in engine.requests  # its output was handed out once
        assert not neighbour.is_finished and neighbour.output_token_ids  # the batch went on
        assert engine.num_waiting_requests == 0
        engine.abort_request("neighbour")
    finally:
        build.gate.set()
        compiler.close()


def test_llm_refuses_a_bad_or_slow_grammar_before_running_anything(llm: LLM, engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="invalid structured output"):
        llm.generate(["a", "b"], [FREE, SamplingParams(structured_outputs={"grammar": "start: ???"})])
    compiler, build = gated_compiler(timeout_s=0.05)
    engine.grammars = compiler
    try:
        with pytest.raises(GrammarTimeoutError, match=envs.GRAMMAR_COMPILE_TIMEOUT_S.name):
            llm.generate(["a", "b"], [FREE, CONSTRAINED])
        assert not engine.requests and engine.num_waiting_requests == 0
        build.gate.set()
        wait_until(lambda: compiler.cache_info().compiling == 0)  # the late compile lands in the cache
        assert llm.generate(["b"], CONSTRAINED)[0].outputs[0].text.isdigit()
    finally:
        build.gate.set()
        compiler.close()


def test_an_invalid_grammar_added_to_the_engine_ends_with_error(engine: LLMEngine) -> None:
    engine.add_request("bad", "x", SamplingParams(structured_outputs={"grammar": "start: ???"}))
    bad = engine.requests["bad"].first
    step_until(engine, lambda: bad.is_finished)
    assert bad.finish_reason == "error" and "bad" not in engine.requests


def test_abort_while_compiling_cancels_a_queued_compile(engine: LLMEngine) -> None:
    compiler, build = gated_compiler(workers=1)
    engine.grammars = compiler
    try:
        engine.add_request("first", "x", CONSTRAINED)
        assert build.started.wait(30)  # the only compile thread is now busy with it
        other = SamplingParams(max_tokens=4, structured_outputs={"regex": "[a-c]{3}"})
        engine.add_request("queued", "y", other)
        assert compiler.cache_info().compiling == 2
        engine.abort_request("queued")
        engine.abort_request("first")  # running: it finishes, is cached, and nobody waits
        assert compiler.cache_info().compiling == 1 and engine.num_waiting_requests == 0
        assert not engine.has_unfinished_requests()
        build.gate.set()
        step_until(engine, lambda: compiler.cache_info().compiling == 0)
        assert build.built == [DIGITS.key]  # the queued grammar was never compiled
    finally:
        build.gate.set()
        compiler.close()


def test_compile_cache_is_bounded_and_shares_compiles() -> None:
    compiler, build = gated_compiler(cache_size=3)
    try:
        # The gate opens only once all four have joined: an open gate lets the compile finish
        # before the later submits, which then count as cache hits instead of joining it.
        shared = [compiler.submit(DIGITS) for _ in range(4)]  # one compile for all four
        build.gate.set()
        assert all(pending.wait() is shared[0].wait() for pending in shared)
        for pending in shared:
            pending.release()
        for index in range(10):
            compiler.matcher(StructuredOutputsParams(regex=f"[a-z]{{{index + 1}}}"))
        info = compiler.cache_info()
        assert info.size == 3 and info.compiling == 0
        assert (info.misses, info.hits) == (11, 0) and len(build.built) == 11
        compiler.matcher(StructuredOutputsParams(regex="[a-z]{10}"))
        assert compiler.cache_info().hits == 1 and len(build.built) == 11
    finally:
        build.gate.set()
        compiler.close()


def test_compile_cache_is_bounded_by_its_grammars_text() -> None:
    compiler, build = gated_compiler(cache_size=100)
    compiler.cache_text_bytes = 1000
    build.gate.set()
    try:
        specs = [StructuredOutputsParams(regex=f"({'a' * 200}){{{index + 1}}}") for index in range(10)]
        for spec in specs:
            compiler.matcher(spec)
        info = compiler.cache_info()
        assert info.text_bytes <= 1000 and info.size == 1000 // len(specs[0].key)
        assert info.text_bytes == sum(len(spec.key) for spec in specs[-info.size:])
        compiler.matcher(specs[-1])  # the newest stayed cached
        assert compiler.cache_info().hits == 1
        huge = StructuredOutputsParams(regex="b" * 2000)  # alone over the budget: kept, all else evicted
        compiler.matcher(huge)
        assert compiler.cache_info()[2:] == (1, 0, len(huge.key))
    finally:
        compiler.close()


def test_timeout_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(envs.GRAMMAR_COMPILE_TIMEOUT_S.name, "2.5")
    assert envs.grammar_compile_timeout_s() == 2.5
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv(envs.GRAMMAR_COMPILE_TIMEOUT_S.name, bad)
        with pytest.raises(ValueError, match=envs.GRAMMAR_COMPILE_TIMEOUT_S.name):
            envs.grammar_compile_timeout_s()


def test_the_core_answers_the_add_once_the_grammar_settles() -> None:
    """Through the engine core (as the server runs it): a bad grammar and a grammar past its
    timeout are refused at `add_request` (a 400 on the server), and nothing stays counted."""
    engine = LLMEngine(tiny_config())
    compiler, build = gated_compiler(timeout_s=2.0, held={DIGITS.key})
    engine.grammars = compiler
    client = AsyncLLMEngine(engine, max_waiting_requests=8)
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def scenario() -> int:
        neighbour = await client.add_request("neighbour", [300] * 8, long)
        await anext(neighbour)
        with pytest.raises(ValueError, match="invalid structured output"):
            await client.add_request("bad", [301] * 8, SamplingParams(structured_outputs={"grammar": "start: ???"}))
        with pytest.raises(ValueError, match="did not compile within"):
            await client.add_request("late", [302] * 8, CONSTRAINED)
        build.gate.set()
        ok = [output async for output in client.generate("ok", [303] * 8, CONSTRAINED)][-1]
        assert ok.outputs[0].text.isdigit()
        tokens = [output async for output in neighbour][-1].outputs[0].token_ids
        return len(tokens)

    try:
        assert asyncio.run(scenario()) == 200
        assert client.num_waiting_estimate == 0
        assert asyncio.run(client.call("has_unfinished_requests")) is False
        asyncio.run(client.check_integrity())
    finally:
        build.gate.set()
        client.shutdown()
        compiler.close()


def test_the_server_answers_a_late_or_bad_grammar_with_400_and_keeps_serving() -> None:
    """Over HTTP: a grammar past its timeout and an invalid one are 400s while a long request
    streams on; the grammar, once compiled, serves the next request."""
    import httpx

    from hybridserve.server.app import build_app
    from tests.helpers.live_server import ServerThread, is_idle

    compiler, build = gated_compiler(timeout_s=1.0, held={DIGITS.key})
    engine = LLMEngine(tiny_config())
    engine.grammars = compiler
    client = AsyncLLMEngine(engine, max_waiting_requests=8)
    body = {"model": "tiny", "prompt": "Constrained", "max_tokens": 8, "temperature": 0.0}
    try:
        with ServerThread(build_app(client, model_name="tiny", api_key=None)) as server, \
                httpx.Client(base_url=server.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json={**body, "prompt": "Neighbour", "max_tokens": 300,
                                                              "ignore_eos": True, "stream": True}) as neighbour:
                lines = neighbour.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                late = http.post("/v1/completions", json={**body, "guided_regex": "[0-9]{6}"})
                assert late.status_code == 400 and "did not compile within" in late.json()["error"]["message"]
                bad = http.post("/v1/completions", json={**body, "guided_grammar": "start: ???"})
                assert bad.status_code == 400 and "invalid structured output" in bad.json()["error"]["message"]
                streamed = [line for line in lines if line.startswith("data:")]
                assert streamed[-1] == "data: [DONE]"
                assert json.loads(streamed[-2].removeprefix("data:"))["choices"][0]["finish_reason"] == "length"
            build.gate.set()
            wait_until(lambda: compiler.cache_info().compiling == 0)
            ok = http.post("/v1/completions", json={**body, "guided_regex": "[0-9]{6}"})
            assert ok.status_code == 200 and ok.json()["choices"][0]["text"].isdigit()
            wait_until(lambda: is_idle(client))
        assert client.num_waiting_estimate == 0
        asyncio.run(client.check_integrity())
    finally:
        build.gate.set()
        client.shutdown()
        compiler.close()


def test_many_grammars_with_aborts_and_failures_leave_nothing_behind(engine: LLMEngine) -> None:
    """Distinct, shared and invalid grammars, some aborted while compiling or running: every
    request ends once, and no claim, compile or waiting place is left."""
    compiler, build = gated_compiler(workers=2)
    engine.grammars = compiler
    try:
        constraints = [{"regex": f"[0-9]{{{index % 4 + 1}}}"} for index in range(12)] + \
                      [{"grammar": "start: ???"}, {"choice": ["yes", "no"]}]
        for index, constraint in enumerate(constraints):
            engine.add_request(f"r{index}", f"prompt {index}",
                               SamplingParams(max_tokens=6, temperature=0.0, structured_outputs=constraint))
        for index in (0, 5, 13):
            engine.abort_request(f"r{index}")
        build.gate.set()
        ended: list[str] = []
        for step in range(10_000):
            if step == 3:
                engine.abort_request("r7")  # perhaps running by now: either way it ends once
            ended += [out.request_id for out in engine.step() if out.finished]
            if not engine.has_unfinished_requests():
                break
        expected = {f"r{index}" for index in range(len(constraints))} - {"r0", "r5", "r13", "r7"}
        assert expected <= set(ended) and len(ended) == len(set(ended))
        assert compiler._claims == {} and compiler.cache_info().compiling == 0
        assert engine.num_waiting_requests == 0 and not engine.requests
    finally:
        build.gate.set()
        compiler.close()

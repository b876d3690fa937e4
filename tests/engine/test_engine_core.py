"""The engine core process (`EngineCoreClient` + `EngineCore`) behind the real HTTP app: same
greedy tokens as `LLM.generate`, streaming and `n`, aborts, bad input, stats, and a core that
dies (requests fail, /health answers 503, nothing is left running)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from hybridserve.api import LLM
from hybridserve.engine import core as core_module
from hybridserve.engine.core import (
    BURST_GAP_S,
    BURST_POLL_MS,
    PARENT_CHECK_S,
    SOCKET_DIR_PREFIX,
    EngineCore,
    SocketInputs,
)
from hybridserve.engine.core_client import EngineCoreClient
from hybridserve.engine.core_messages import (
    AbortRequests,
    AddRequest,
    CoreInput,
    EngineDead,
    SamplingParamsWire,
    Shutdown,
    StepOutputs,
    UtilityCall,
    input_decoder,
    output_decoder,
    params_from_wire,
    params_to_wire,
)
from hybridserve.engine.frames import FrameOutbox, FrameReceiver, FrameSender, encode_frame
from hybridserve.errors import (
    EngineDeadError,
    EngineOverloadedError,
    EngineStepError,
    InvalidRequestError,
)
from hybridserve.sampling_params import (
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from hybridserve.server.app import build_app
from tests.helpers.live_server import ServerThread, random_ids, tiny_config, wait_until

MODEL = "tiny"
VOCAB = 4096

pytestmark = pytest.mark.timeout(180)


def is_idle(core: EngineCoreClient) -> bool:
    """Nothing holds a KV block or a state slot in the core."""
    stats = asyncio.run(core.stats())
    return (stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_blocks_used"] == 0
            and stats["state_slots_free"] == stats["state_slots_total"])


def check_clean(core: EngineCoreClient) -> None:
    """Idle, and the pools pass their integrity checks."""
    wait_until(lambda: is_idle(core))
    asyncio.run(core.check_integrity())


def reader_thread_running() -> bool:
    """Whether an engine core client's reader thread is alive (it ends once a loop reads)."""
    return any(thread.name == "hybridserve-core-reader" and thread.is_alive() for thread in threading.enumerate())


def process_gone(pid: int) -> bool:
    """The process has exited and been reaped (or was never ours)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as stat:  # a zombie still answers kill(0)
        return stat.read().split()[2] == "Z"


@pytest.fixture(scope="module")
def core() -> Iterator[EngineCoreClient]:
    client = EngineCoreClient(tiny_config(), max_waiting_requests=64)
    client.start()
    yield client
    pid = client.pid
    client.shutdown()
    assert pid is not None and process_gone(pid)


@pytest.fixture(scope="module")
def server(core: EngineCoreClient) -> Iterator[ServerThread]:
    with ServerThread(build_app(core, model_name=MODEL), core) as srv:  # outputs read on its loop
        yield srv


def _prompts() -> list[list[int]]:
    return [[300 + (7 * i + 13 * j) % 3000 for j in range(20 + 5 * i)] for i in range(3)]


def test_same_greedy_tokens_as_llm_generate(core: EngineCoreClient, server: ServerThread) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    offline = LLM.from_config(tiny_config()).generate(_prompts(), params, use_tqdm=False)

    async def through_core() -> list[list[int]]:
        outs = []
        for i, prompt in enumerate(_prompts()):
            last = None
            async for output in core.generate(f"parity-{i}", prompt, params):
                last = output
            assert last is not None and last.finished
            outs.append(last.outputs[0].token_ids)
        return outs

    assert asyncio.run(through_core()) == [o.outputs[0].token_ids for o in offline]
    body = {"model": MODEL, "prompt": _prompts(), "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    texts = [c["text"] for c in httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"]]
    assert texts == [o.outputs[0].text for o in offline]
    streamed = _stream_texts(server, {**body, "prompt": _prompts()[0]})
    assert streamed == {0: offline[0].outputs[0].text}
    check_clean(core)


def _stream_texts(server: ServerThread, body: dict) -> dict[int, str]:
    texts: dict[int, str] = {}
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return texts


def test_streaming_n_logprobs_stop_and_stats(core: EngineCoreClient, server: ServerThread) -> None:
    body = {"model": MODEL, "prompt": "The joint prefix cache", "max_tokens": 12, "temperature": 0.8,
            "seed": 3, "n": 2, "logprobs": 1}
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert [c["text"] for c in whole["choices"]] == list(_stream_texts(server, body).values())
    assert all(len(c["logprobs"]["tokens"]) == whole["usage"]["completion_tokens"] // 2 for c in whole["choices"])
    text = whole["choices"][0]["text"]
    if len(text) > 3:  # a stop string inside the text cuts it there
        stopped = httpx.post(f"{server.url}/v1/completions", json={**body, "n": 1, "stop": [text[2:4]]}).json()
        assert stopped["choices"][0]["text"] == text[:2] and stopped["choices"][0]["finish_reason"] == "stop"
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "hybridserve_kv_blocks_total" in metrics or "kv_blocks" in metrics
    assert httpx.get(f"{server.url}/health").status_code == 200
    check_clean(core)


def test_text_is_made_in_the_api_process_except_for_stop_strings(core: EngineCoreClient) -> None:
    """The core detokenizes only requests with stop strings (the stop is checked on the text); the
    others' text is made from their token ids on the API side and equals `LLM.generate`'s, also
    when a delta carries several tokens (stream_interval) and with special tokens kept or skipped.
    Ids from the whole vocabulary: byte pieces included."""
    assert asyncio.run(core.call("detokenize_all_requests")) is False
    prompts = [[(97 * i + 31 * j) % VOCAB for j in range(12)] for i in range(4)]
    cases = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True, stream_interval=1 + 3 * (i % 2),
                            skip_special_tokens=i < 2) for i in range(4)]
    llm = LLM.from_config(tiny_config())
    offline = [llm.generate([prompt], params, use_tqdm=False)[0].outputs[0] for prompt, params in zip(prompts, cases)]

    async def through_core(params_list: list[SamplingParams], tag: str) -> list[Any]:
        outs = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            last = None
            async for output in core.generate(f"detok-{tag}-{i}", prompt, params):
                last = output
            outs.append(last.outputs[0])
        return outs

    served = asyncio.run(through_core(cases, "api"))
    assert [(o.token_ids, o.text) for o in served] == [(o.token_ids, o.text) for o in offline]
    assert any(o.text for o in served)
    stops = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True, stop=[o.text[5:7]])
             for i, o in enumerate(offline) if len(o.text) > 8]
    stopped = asyncio.run(through_core(stops, "stop"))
    expected = [llm.generate([prompts[i]], params, use_tqdm=False)[0].outputs[0].text
                for i, params in zip([i for i, o in enumerate(offline) if len(o.text) > 8], stops)]
    assert stops and [o.text for o in stopped] == expected
    assert all(o.finish_reason == "stop" for o in stopped)
    check_clean(core)


def test_final_only_requests_get_one_message(core: EngineCoreClient) -> None:
    """The core holds a final-only request's deltas back until it finishes: its stream yields one
    output, the cumulative run's last."""
    async def outputs(kind: RequestOutputKind) -> list:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, output_kind=kind)
        return [out async for out in core.generate(f"core-kind-{int(kind)}", [400, 401, 402], params)]

    cumulative = asyncio.run(outputs(RequestOutputKind.CUMULATIVE))
    final = asyncio.run(outputs(RequestOutputKind.FINAL_ONLY))
    assert len(cumulative) > 1 and len(final) == 1 and final[0].finished
    assert final[0].outputs[0].token_ids == cumulative[-1].outputs[0].token_ids and final[0].prompt_token_ids
    check_clean(core)


def test_stream_interval_holds_deltas_back(core: EngineCoreClient) -> None:
    """The core sends a request with `stream_interval=5` its first token, then a delta per 5 new
    tokens, then the last: the stream yields those outputs, ending in the cumulative run's."""
    async def outputs(interval: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True, stream_interval=interval)
        return [out.outputs[0].token_ids async for out in core.generate(f"core-interval-{interval}",
                                                                         [410, 411, 412], params)]

    every, chunked = asyncio.run(outputs(1)), asyncio.run(outputs(5))
    assert [len(ids) for ids in chunked] == [1, 6, 11, 16, 21, 23] and chunked[-1] == every[-1]
    check_clean(core)


def test_bad_input_is_a_400_with_the_engine_message(core: EngineCoreClient, server: ServerThread) -> None:
    response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": [1, VOCAB + 5]})
    assert response.status_code == 400 and "outside the vocabulary" in response.json()["error"]["message"]
    check_clean(core)


def test_disconnect_mid_stream_aborts(core: EngineCoreClient, server: ServerThread) -> None:
    body = {"model": MODEL, "prompt": "abort me", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    check_clean(core)


def test_core_death_fails_requests_and_health() -> None:
    client = EngineCoreClient(tiny_config(), max_waiting_requests=8)
    client.start()
    pid = client.pid
    assert pid is not None
    body = {"model": MODEL, "prompt": "long", "max_tokens": 5000, "ignore_eos": True, "stream": True}
    try:
        with ServerThread(build_app(client, model_name=MODEL), client) as srv:
            assert httpx.get(f"{srv.url}/health").status_code == 200
            wait_until(lambda: not reader_thread_running())  # the server's loop reads the outputs
            # The read timeout only bounds a hang: the stream must end with the core's death.
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
                os.kill(pid, signal.SIGKILL)
                rest = [line for line in lines if line]
            assert "engine core process died" in json.loads(rest[-2][6:])["error"]["message"]
            assert rest[-1] == "data: [DONE]"
            assert httpx.get(f"{srv.url}/health").status_code == 503
            assert httpx.get(f"{srv.url}/ready").status_code == 503
            again = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
            assert again.status_code == 503
            with pytest.raises(EngineDeadError):
                asyncio.run(client.stats())
    finally:
        client.shutdown()
    assert process_gone(pid)


def test_aborts_that_empty_the_queue_reopen_admission() -> None:
    """The API process admits requests by the core's waiting count. When aborts empty the engine
    no step follows to report it, and a stale count refused every request as overloaded, for good."""
    client = EngineCoreClient(tiny_config(max_num_seqs=1), max_waiting_requests=2)
    client.start()
    long = SamplingParams(max_tokens=5000, ignore_eos=True, temperature=0.0)

    async def scenario() -> list[int]:
        await client.add_request("running", [300] * 20, long)
        await asyncio.to_thread(wait_until, lambda: client.num_waiting_estimate == 0)
        for index in range(2):
            await client.add_request(f"queued-{index}", [301 + index] * 20, long)
        await asyncio.to_thread(wait_until, lambda: client.num_waiting_estimate == 2)
        with pytest.raises(EngineOverloadedError):
            await client.add_request("refused", [303] * 20, long)
        for request_id in ("queued-0", "queued-1", "running"):
            client.abort(request_id)
        await asyncio.to_thread(wait_until, lambda: client.num_waiting_estimate == 0)
        outputs = [output async for output in client.generate("after", [304] * 20,
                                                              SamplingParams(max_tokens=3, temperature=0.0))]
        return outputs[-1].outputs[0].token_ids

    try:
        assert len(asyncio.run(scenario())) == 3
        asyncio.run(client.check_integrity())
    finally:
        client.shutdown()


def test_bad_model_dir_fails_start_with_the_engine_error() -> None:
    from dataclasses import replace

    client = EngineCoreClient(replace(tiny_config(), model="/nonexistent/model-dir"))
    with pytest.raises((ValueError, OSError), match="does not exist"):
        client.start()
    assert client.pid is not None and process_gone(client.pid)
    client.shutdown()


@pytest.mark.slow
def test_core_exits_when_the_api_process_is_killed() -> None:
    from hybridserve.bench.serve_bench import ServerProcess

    def socket_dirs() -> set[Path]:
        return set(Path(tempfile.gettempdir()).glob(SOCKET_DIR_PREFIX + "*"))

    before = socket_dirs()
    with ServerProcess(["--kv-cache-mib", "16", "--prefix-cache-mib", "16", "--max-model-len", "1024",
                        "--threads", "1"]) as server:
        assert server.proc is not None
        pid = server.proc.pid
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            cores = [int(c) for c in children.read().split()]
        assert cores, "the server has no engine core child"
        ours = socket_dirs() - before
        assert ours, "the server made no socket directory"
        os.kill(pid, signal.SIGKILL)
        server.proc.wait(10)
        wait_until(lambda: all(process_gone(c) for c in cores), timeout=10)
    assert not any(d.exists() for d in ours), "the core left the dead server's sockets behind"


class _RecordingEngine:
    """Stands in for `LLMEngine` in `EngineCore`: records the order in which requests were added."""

    def __init__(self) -> None:
        self.added: list[str] = []

    def add_request(self, request_id: str, prompt: Any, params: Any, cache_salt: str | None = None) -> None:
        self.added.append(request_id)


class _ListSink:
    """Collects the core's output messages (instead of the frames of a real core)."""

    def __init__(self) -> None:
        self.messages: list[Any] = []

    def send_message(self, message: Any) -> None:
        self.messages.append(message)


class _VirtualClock:
    """The core module's clock in the burst test: it moves only when the core waits on its input
    socket, so whether a request falls inside the burst gap depends on the order of events, not on
    how fast this machine runs."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        """The virtual time in seconds."""
        return self.now


class _ScriptedInputs:
    """The core's input socket: records the timeout of every wait (`poll`), runs the action
    scheduled for a wait (sending a request that arrives during it), and advances the virtual
    clock by the wait's whole timeout when nothing arrived, by nothing when something did."""

    def __init__(self, sock: socket.socket, clock: _VirtualClock) -> None:
        self.clock = clock
        self.socket_inputs = SocketInputs(sock)
        self.waits: list[int] = []
        self.during_wait: dict[int, Callable[[], None]] = {}  # wait number (from 1) -> what arrives

    def poll(self, timeout_ms: int) -> int:
        self.waits.append(timeout_ms)
        arrival = self.during_wait.pop(len(self.waits), None)
        if arrival is not None:
            arrival()
        ready = self.socket_inputs.poll(timeout_ms if arrival is not None else 0)
        if not ready:
            self.clock.now += timeout_ms / 1000
        return ready

    def receive(self) -> Any:
        return self.socket_inputs.receive()


def test_an_idle_core_gathers_a_burst_but_not_a_lone_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests arriving together start a burst: the core keeps taking requests that follow
    within BURST_GAP_S before its first step; a lone request is handled without a further wait,
    and a busy core does not wait at all."""
    clock = _VirtualClock()
    monkeypatch.setattr(core_module, "time", clock)
    api_end, core_end = socket.socketpair()
    engine, inputs = _RecordingEngine(), _ScriptedInputs(core_end, clock)
    core = EngineCore(engine, inputs, _ListSink(), os.getppid())
    encoder, params = msgspec.msgpack.Encoder(), params_to_wire(SamplingParams(max_tokens=1))
    parent_check_ms = int(PARENT_CHECK_S * 1000)

    def send(request_id: str) -> None:  # a socket pair delivers at once
        api_end.sendall(encode_frame(encoder, AddRequest(request_id, [1, 2, 3], params, None)))

    try:
        send("alone")
        core._drain_inputs(block=True)
        assert engine.added == ["alone"]
        assert inputs.waits == [parent_check_ms]  # the wait for the request itself, none for followers

        inputs.waits.clear()
        send("burst-0")
        send("burst-1")
        inputs.during_wait[2] = lambda: send("burst-2")  # arrives during the first wait for followers
        core._drain_inputs(block=True)
        assert engine.added == ["alone", "burst-0", "burst-1", "burst-2"]
        followers = inputs.waits[1:]
        assert inputs.waits[0] == parent_check_ms and followers and set(followers) == {BURST_POLL_MS}
        # After burst-2 the core kept waiting for more until a quiet BURST_GAP_S passed, then stopped.
        assert len(followers) >= 2 and clock.now >= BURST_GAP_S

        inputs.waits.clear()
        send("next")
        core._drain_inputs(block=False)  # a busy core never waits
        assert engine.added[-1] == "next" and inputs.waits == []
    finally:
        api_end.close()
        core_end.close()


def test_outputs_move_to_a_loop_and_back_to_the_reader_thread() -> None:
    """After `read_on_loop` the reader thread ends and that loop reads the core's outputs, also for
    streams of other loops; once that loop is closed, the next request resumes the thread."""
    client = EngineCoreClient(tiny_config(), max_waiting_requests=8)
    client.start()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def tokens(request_id: str) -> list[int]:
        last = None
        async for output in client.generate(request_id, [5, 6, 7, 8], params):
            last = output
        assert last is not None and last.finished
        return last.outputs[0].token_ids

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        assert reader_thread_running()
        client.read_on_loop(loop)
        wait_until(lambda: not reader_thread_running())
        on_loop = asyncio.run_coroutine_threadsafe(tokens("on-loop"), loop).result(60)
        assert len(on_loop) == 8 and asyncio.run(tokens("other-loop")) == on_loop
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
        assert asyncio.run(tokens("after-close")) == on_loop and reader_thread_running()
        check_clean(client)
    finally:
        client.shutdown()
    assert not reader_thread_running()


def test_frames_carry_typed_messages_across_read_boundaries() -> None:
    """Messages arrive whole and in order however the reads cut them (5-byte reads here, a frame
    over the 64 KiB the sender's reused buffer keeps); a frame that does not decode is skipped
    and the ones after it still arrive; nothing waiting reads as []; the peer's close as None."""
    ours, theirs = socket.socketpair()
    sender, receiver = FrameSender(ours), FrameReceiver(theirs, output_decoder(), read_bytes=5)
    messages = [StepOutputs([], 3), EngineDead("x" * 70_000), StepOutputs([], 0), EngineDead("")]
    sender.send_message(messages[0])
    ours.sendall(len(b"\xc1not msgpack").to_bytes(4, "little") + b"\xc1not msgpack")
    for message in messages[1:]:
        sender.send_message(message)
    received: list[Any] = []
    while len(received) < len(messages):
        batch = receiver.receive_messages(5.0)
        assert batch is not None
        received += batch
    assert received == messages
    assert receiver.receive_messages(0) == [] and receiver.receive_messages(0.01) == []
    ours.close()
    assert receiver.receive_messages(5.0) is None
    theirs.close()


def _every_sampling_field() -> SamplingParams:
    """Sampling parameters with every field away from its default."""
    return SamplingParams(
        n=3, max_tokens=77, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=11, stop=["\n\n", "END"],
        stop_token_ids=[5, 6], ignore_eos=True, min_tokens=2, logprobs=4, presence_penalty=0.5,
        frequency_penalty=-0.25, repetition_penalty=1.1, include_stop_str_in_output=True,
        skip_special_tokens=False, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
        logit_bias={7: 2, 9: -1.5}, output_kind=RequestOutputKind.FINAL_ONLY, stream_interval=4)


def _plain_values(value: Any) -> bool:
    """Whether a decoded msgpack value holds only lists, dicts, str, numbers, bools and None."""
    if isinstance(value, list):
        return all(_plain_values(item) for item in value)
    if isinstance(value, dict):
        return all(_plain_values(k) and _plain_values(v) for k, v in value.items())
    return value is None or isinstance(value, (str, int, float, bool))


@pytest.mark.parametrize("constraint", [
    None, StructuredOutputsParams(choice=["a", "b"]), StructuredOutputsParams(regex="[0-9]+"),
    StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}}),
    StructuredOutputsParams(json_object=True), StructuredOutputsParams(grammar='start: "x"'),
])
def test_requests_cross_the_wire_typed_and_without_pickle(constraint: StructuredOutputsParams | None) -> None:
    """An `AddRequest` encodes to plain msgpack values (no bytes, so no pickle anywhere in it) and
    decodes to equal `SamplingParams`, structured-output constraint included."""
    params = _every_sampling_field()
    params.structured_outputs = constraint
    encoded = msgspec.msgpack.Encoder().encode(AddRequest("req-1", [1, 2, 3], params_to_wire(params), "salt"))
    assert _plain_values(msgspec.msgpack.decode(encoded))
    decoded = input_decoder().decode(encoded)
    assert isinstance(decoded, AddRequest)
    assert params_from_wire(decoded.params) == params


def test_no_message_to_the_core_has_a_bytes_field() -> None:
    """Every API -> core message is typed: no field is opaque bytes (where a pickle could hide),
    and the wire form of the sampling parameters has exactly `SamplingParams`' fields."""
    for kind in (AddRequest, AbortRequests, UtilityCall, Shutdown, SamplingParamsWire):
        info = msgspec.inspect.type_info(kind)
        assert isinstance(info, msgspec.inspect.StructType)
        assert not [f.name for f in info.fields if "Bytes" in repr(f.type)], kind
    assert {m.__name__ for m in CoreInput.__args__} == {"AddRequest", "AbortRequests", "UtilityCall", "Shutdown"}
    import dataclasses
    assert list(SamplingParamsWire.__struct_fields__) == [f.name for f in dataclasses.fields(SamplingParams)]


def test_wire_params_are_validated_again_on_arrival() -> None:
    """A wire message with an out-of-range value is refused by the core's conversion, as a
    `ValueError`, instead of reaching the engine."""
    wire = params_to_wire(SamplingParams(max_tokens=4))
    wire.temperature = -1.0
    with pytest.raises(ValueError, match="temperature"):
        params_from_wire(wire)


def test_utility_calls_reach_public_engine_names_only(core: EngineCoreClient) -> None:
    """Utility calls name a public engine method (with plain arguments) or attribute; private
    names are refused, and errors come back as the shared error classes."""
    assert asyncio.run(core.call("has_unfinished_requests")) is False
    with pytest.raises(InvalidRequestError, match="public"):
        asyncio.run(core.call("_step"))
    with pytest.raises(RuntimeError):
        asyncio.run(core.call("no_such_method"))
    with pytest.raises(InvalidRequestError, match="empty"):  # the engine's own ValueError, by kind
        asyncio.run(core.add_request("empty-prompt", "", SamplingParams(max_tokens=1)))


def test_both_front_ends_are_engine_clients() -> None:
    """The in-process `AsyncLLMEngine` and the out-of-process `EngineCoreClient` implement the one
    `EngineClient` interface the server talks to, with the same parameter names."""
    import inspect
    from types import SimpleNamespace

    from hybridserve.engine.async_engine import AsyncLLMEngine
    from hybridserve.engine.protocol import EngineClient

    in_process = AsyncLLMEngine(SimpleNamespace(tokenizer=None, max_model_len=64))  # type: ignore[arg-type]
    clients = [in_process, EngineCoreClient(tiny_config())]
    methods = [name for name, value in vars(EngineClient).items()
               if not name.startswith("_") and inspect.isfunction(value)]
    assert {"add_request", "abort", "call", "stats", "check_integrity", "start", "shutdown"} <= set(methods)
    for client in clients:
        assert isinstance(client, EngineClient), type(client).__name__
        for name in methods:
            expected = list(inspect.signature(getattr(EngineClient, name)).parameters)
            assert list(inspect.signature(getattr(type(client), name)).parameters) == expected, (client, name)


def test_both_directions_share_one_socket_without_deadlock() -> None:
    """Inputs and outputs cross one socket at once, each direction more than the socket holds:
    queuing inputs never blocks the caller (the outbox's thread writes them), and reading outputs
    does not wait on that thread, so a core that writes before it reads cannot deadlock."""
    api_end, core_end = socket.socketpair()
    count, filler = 20, "x" * 100_000
    inputs = [UtilityCall(i, "method", [filler]) for i in range(count)]
    outputs = [EngineDead(f"{i}{filler}") for i in range(count)]
    received_inputs: list[Any] = []

    def core_side() -> None:
        core_inputs, sender = SocketInputs(core_end), FrameSender(core_end)
        for message in outputs:  # each write blocks until the API side reads
            sender.send_message(message)
            while (received := core_inputs.receive()) is not None:
                received_inputs.append(received)
        deadline = time.monotonic() + 60  # a bound on a hang, not a speed check
        while len(received_inputs) < count and time.monotonic() < deadline:
            if core_inputs.poll(1_000):  # one read: a partial frame polls as 0, so keep going
                received_inputs.append(core_inputs.receive())

    core_thread = threading.Thread(target=core_side, daemon=True)
    core_thread.start()
    outbox = FrameOutbox(api_end, max_bytes=1 << 30)
    encoder = msgspec.msgpack.Encoder()
    for message in inputs:
        outbox.put(encode_frame(encoder, message))
    receiver, received_outputs = FrameReceiver(api_end, output_decoder()), []
    while len(received_outputs) < count:
        batch = receiver.receive_messages(5.0)
        assert batch is not None
        received_outputs += batch
    core_thread.join(30)
    assert received_outputs == outputs and received_inputs == inputs
    deadline = time.monotonic() + 30  # the sender thread subtracts a write only after sendall returns,
    while outbox.queued_bytes and time.monotonic() < deadline:  # which can be after the peer read it
        time.sleep(0.01)
    assert outbox.queued_bytes == 0
    outbox.close()
    api_end.close()
    core_end.close()


def test_an_unencodable_token_id_is_a_400_and_takes_no_waiting_slot(core: EngineCoreClient,
                                                                    server: ServerThread) -> None:
    """A token id msgpack cannot carry (2**64) is refused as bad input before a waiting slot is
    taken: refusing more of them than the waiting limit leaves the count unchanged and later
    requests admitted."""
    limit = core.max_waiting_requests
    assert limit is not None
    params = SamplingParams(max_tokens=2, temperature=0.0)

    async def scenario() -> RequestOutput:
        before = core.num_waiting_estimate
        for index in range(limit + 1):
            with pytest.raises(InvalidRequestError, match="cannot send AddRequest"):
                await core.add_request(f"huge-{index}", [5, 2**64], params)
            assert core.num_waiting_estimate == before
        return [output async for output in core.generate("after-huge", [5, 6], params)][-1]

    assert asyncio.run(scenario()).finished
    response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": [5, 2**64]})
    assert response.status_code == 400
    check_clean(core)


def test_a_full_outbox_refuses_adds_but_not_aborts() -> None:
    """With the core stopped (SIGSTOP) nothing drains the outbox: adds are queued without
    blocking the loop until it is over its bound, then refused with `EngineOverloadedError`; an
    abort sent then still reaches the core, so the aborted request does not run on."""
    client = EngineCoreClient(tiny_config(), max_waiting_requests=1000, max_outbox_bytes=1 << 16)
    client.start()
    pid = client.pid
    assert pid is not None
    long, big_prompt = SamplingParams(max_tokens=5000, ignore_eos=True, temperature=0.0), "word " * 40_000

    async def scenario() -> None:
        await client.add_request("victim", [300] * 20, long)
        fillers: list[asyncio.Task[Any]] = []
        os.kill(pid, signal.SIGSTOP)
        try:
            for index in range(1000):
                task = asyncio.create_task(client.add_request(f"filler-{index}", big_prompt, long))
                await asyncio.sleep(0)  # the task runs until it waits for the core's answer, or fails
                if task.done():
                    break
                fillers.append(task)
            assert fillers and isinstance(task.exception(), EngineOverloadedError)
            for request_id in ["victim"] + [f"filler-{i}" for i in range(len(fillers))]:
                client.abort(request_id)
        finally:
            os.kill(pid, signal.SIGCONT)
        await asyncio.gather(*fillers, return_exceptions=True)  # the core has read every add
        assert await client.call("has_unfinished_requests") is False  # read after the aborts

    try:
        asyncio.run(scenario())
        check_clean(client)
    finally:
        client.shutdown()


def test_a_utility_call_times_out_and_leaves_nothing_pending() -> None:
    """A call the engine does not answer within `call_timeout_s` raises `TimeoutError` and drops
    its pending entry; its late answer is ignored and the next call is answered."""
    from types import SimpleNamespace

    from hybridserve.engine.async_engine import AsyncLLMEngine

    release = threading.Event()
    engine = SimpleNamespace(tokenizer=None, max_model_len=64, num_waiting_requests=0,
                             has_unfinished_requests=lambda: False, wait_for_release=release.wait)
    client = AsyncLLMEngine(engine, call_timeout_s=0.05)
    try:
        with pytest.raises(TimeoutError, match="wait_for_release"):
            asyncio.run(client.call("wait_for_release"))
        assert not client._calls
        release.set()
        client.call_timeout_s = 60.0
        assert asyncio.run(client.call("max_model_len")) == 64
    finally:
        client.shutdown()


def test_a_stopped_core_fails_health_and_recovers() -> None:
    """A core stopped with SIGSTOP sends no heartbeat: `/health` and `/ready` answer 503 within
    the heartbeat bound; after SIGCONT both answer 200 again and requests are served."""
    client = EngineCoreClient(tiny_config())
    client.start()
    pid = client.pid
    assert pid is not None

    def status(srv: ServerThread, route: str) -> int:
        return httpx.get(f"{srv.url}{route}", timeout=30).status_code

    try:
        with ServerThread(build_app(client, model_name=MODEL), client) as srv:
            assert status(srv, "/health") == 200 and status(srv, "/ready") == 200
            os.kill(pid, signal.SIGSTOP)
            try:
                wait_until(lambda: status(srv, "/health") == 503, timeout=60)
                assert status(srv, "/ready") == 503
                assert "no heartbeat" in httpx.get(f"{srv.url}/health").json()["error"]["message"]
            finally:
                os.kill(pid, signal.SIGCONT)
            wait_until(lambda: status(srv, "/health") == 200, timeout=60)
            assert status(srv, "/ready") == 200
            body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2}
            assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        client.shutdown()


def test_a_long_step_keeps_the_core_healthy() -> None:
    """The heartbeat comes from a thread of the core, so one step that lasts longer than the
    heartbeat bound does not look like a hung core."""
    from types import SimpleNamespace

    from hybridserve.engine.async_engine import AsyncLLMEngine

    in_step, release = threading.Event(), threading.Event()
    pending = [True]

    def long_step() -> list[Any]:
        in_step.set()
        release.wait(60)
        pending[0] = False
        return []

    engine = SimpleNamespace(tokenizer=None, max_model_len=64, num_waiting_requests=0,
                             has_unfinished_requests=lambda: pending[0], step_groups=long_step)
    client = AsyncLLMEngine(engine)
    client.heartbeat_timeout_s = 4 * core_module.HEARTBEAT_INTERVAL_S
    client.start()
    try:
        assert in_step.wait(30)
        problems = []
        for _ in range(int(3 * client.heartbeat_timeout_s / 0.05)):  # three bounds' worth of polls
            problems.append(client.health_problem)
            threading.Event().wait(0.05)
        release.set()
        assert problems == [None] * len(problems)
    finally:
        release.set()
        client.shutdown()


def test_a_failing_message_handler_answers_its_sender_and_the_core_runs_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every input handler is guarded: an add whose handling raises is refused, a utility call
    whose handling raises raises, and a request whose abort raises is dropped all the same; the
    core keeps serving the others, and nothing leaks."""
    from hybridserve.engine.async_engine import AsyncLLMEngine
    from hybridserve.engine.engine import LLMEngine

    original_add, original_abort, original_call = EngineCore._add, EngineCore._abort, EngineCore._call

    def failing_add(self: EngineCore, message: AddRequest) -> None:
        if message.request_id == "bad-add-early":
            raise RuntimeError("injected add failure")
        original_add(self, message)  # accepted and answered, then the handler raises
        if message.request_id == "bad-add-late":
            raise RuntimeError("injected late add failure")

    def failing_abort(self: EngineCore, request_id: str) -> None:
        if request_id == "bad-abort":
            raise RuntimeError("injected abort failure")
        original_abort(self, request_id)

    def failing_call(self: EngineCore, message: UtilityCall) -> None:
        if message.method == "num_running_requests":
            raise RuntimeError("injected call failure")
        original_call(self, message)

    monkeypatch.setattr(EngineCore, "_add", failing_add)
    monkeypatch.setattr(EngineCore, "_abort", failing_abort)
    monkeypatch.setattr(EngineCore, "_call", failing_call)
    client = AsyncLLMEngine(LLMEngine(tiny_config()), max_waiting_requests=8)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    long = SamplingParams(max_tokens=5000, ignore_eos=True, temperature=0.0)

    async def scenario() -> list[RequestOutput]:
        with pytest.raises(RuntimeError, match="injected add failure"):
            await client.add_request("bad-add-early", [300] * 8, greedy)
        late = await client.add_request("bad-add-late", [300] * 8, long)
        with pytest.raises(EngineStepError, match="injected late add failure"):
            [output async for output in late]
        with pytest.raises(RuntimeError, match="injected call failure"):
            await client.call("num_running_requests")
        stream = await client.add_request("bad-abort", [301] * 8, long)
        await anext(stream)
        client.abort("bad-abort")
        survivors = [[o async for o in client.generate(f"ok-{i}", [302 + i] * 8, greedy)][-1] for i in range(2)]
        await asyncio.to_thread(wait_until, lambda: client.engine.num_running_requests == 0)
        return survivors

    try:
        survivors = asyncio.run(scenario())
        assert client.num_waiting_estimate == 0
        assert [len(out.outputs[0].token_ids) for out in survivors] == [4, 4]
        assert all(out.outputs[0].finish_reason == "length" for out in survivors)
        assert client.is_running and client.health_problem is None
        assert asyncio.run(client.call("has_unfinished_requests")) is False
        asyncio.run(client.check_integrity())
    finally:
        client.shutdown()


def test_metrics_and_tokenize_flood_during_a_long_prefill(core: EngineCoreClient, server: ServerThread) -> None:
    """Scrapes of `/metrics` (each a call to the core) and `/tokenize` requests from eight clients at
    once, while a long prompt prefills: every one is answered, `/health` keeps answering (the bound
    only catches a freeze), and the long request finishes normally."""
    long_body = {"model": MODEL, "prompt": random_ids(91, 3000), "max_tokens": 8, "ignore_eos": True}
    results: dict[str, Any] = {}
    long_thread = threading.Thread(target=lambda: results.update(
        long=httpx.post(f"{server.url}/v1/completions", json=long_body, timeout=120)))
    long_thread.start()
    statuses: list[int] = []

    def flood(worker: int) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for i in range(40):
                if i % 2:
                    statuses.append(client.get("/metrics").status_code)
                else:
                    body = {"model": MODEL, "prompt": f"flood {worker} {i} " * 50}
                    statuses.append(client.post("/tokenize", json=body).status_code)

    flooders = [threading.Thread(target=flood, args=(w,)) for w in range(8)]
    for thread in flooders:
        thread.start()
    health_seconds = []
    with httpx.Client(base_url=server.url, timeout=10) as client:
        while any(thread.is_alive() for thread in flooders):
            start = time.monotonic()
            assert client.get("/health").status_code == 200
            health_seconds.append(time.monotonic() - start)
            time.sleep(0.05)
    for thread in [*flooders, long_thread]:
        thread.join(120)
    assert statuses == [200] * 320
    assert max(health_seconds) < 5  # a frozen loop would stall it for the whole flood
    choice = results["long"].json()["choices"][0]
    assert results["long"].status_code == 200 and choice["finish_reason"] == "length"
    check_clean(core)

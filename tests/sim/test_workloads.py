"""Generated workloads (`hybridserve sim --workload`): seeded and deterministic, Mooncake-shaped,
read by `TraceTokens` as the conversations they were built as, and each family's structure."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest

from hybridserve.cli import main
from hybridserve.sim.trace import TRACE_BLOCK_TOKENS, TraceTokens, read_trace
from hybridserve.sim.workloads import WORKLOADS, GeneratedRequest, generate, to_records, write_trace

SIZE = 400


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workload_is_deterministic_per_seed(name: str) -> None:
    assert generate(name, SIZE, seed=3) == generate(name, SIZE, seed=3)
    assert generate(name, SIZE, seed=3) != generate(name, SIZE, seed=4)
    assert generate(name, 50, seed=3) == generate(name, SIZE, seed=3)[:50]


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workload_is_well_formed_and_read_as_built(name: str) -> None:
    requests = generate(name, SIZE, seed=1)
    assert len(requests) == SIZE
    for index, request in enumerate(requests):
        assert len(request.hash_ids) == math.ceil(request.input_length / TRACE_BLOCK_TOKENS)
        assert request.output_length >= 1
        assert index == 0 or request.timestamp >= requests[index - 1].timestamp
        if request.parent is not None:
            parent = requests[request.parent]
            assert request.parent < index
            assert request.input_length >= parent.input_length + parent.output_length
            full = parent.input_length // TRACE_BLOCK_TOKENS
            assert request.hash_ids[:full] == parent.hash_ids[:full]
    tokens = TraceTokens(to_records(requests), TRACE_BLOCK_TOKENS, 4096)
    for index, request in enumerate(requests):
        tokens.prompt(index)
        tokens.output(index)
        assert tokens.predecessor(index) == request.parent, index
    assert sum(r.parent is not None for r in requests) > SIZE // 40         # later turns of earlier requests


def _children(requests: list[GeneratedRequest]) -> Counter[int]:
    return Counter(r.parent for r in requests if r.parent is not None)


def test_agent_shares_few_system_prompts_and_branches() -> None:
    requests = generate("agent", SIZE, seed=2)
    assert len({r.hash_ids[0] for r in requests}) <= 4             # every request opens with a system prompt
    assert max(_children(requests).values()) >= 2                  # several continuations of one state
    first_turns = sum(r.parent is None for r in requests)
    assert first_turns >= 100                                      # many sessions live at once


def test_chat_conversations_share_few_system_prompts() -> None:
    requests = generate("chat", SIZE, seed=2)
    assert len({r.hash_ids[0] for r in requests}) <= 3
    assert max(_children(requests).values()) == 1                  # no branches: one line per conversation
    assert sum(r.parent is None for r in requests) >= 100


def test_chat_regenerate_is_chat_with_sibling_turns() -> None:
    requests = generate("chat-regenerate", SIZE, seed=2)
    assert len({r.hash_ids[0] for r in requests}) <= 3
    widths = Counter(_children(requests).values())
    assert set(widths) <= {1, 2, 3} and widths[2] + widths[3] >= 5     # regenerated turns: 2-3 siblings
    assert widths[1] > 2 * (widths[2] + widths[3])                     # most turns are not regenerated
    assert generate("chat", 50, seed=2) != requests[:50]


def test_conversation_synthetic_shares_one_system_block_and_documents() -> None:
    requests = generate("conversation-synthetic", SIZE, seed=2)
    assert len({r.hash_ids[0] for r in requests}) == 1
    first_turns = [r for r in requests if r.parent is None]
    second_ids = Counter(r.hash_ids[1] for r in first_turns)
    assert max(second_ids.values()) >= 2                           # a shared document opens several


def test_mixed_interleaves_tenants_apart_and_in_order() -> None:
    requests = generate("mixed", SIZE, seed=2)
    tenants = [generate(name, SIZE, seed=2) for name in ("agent", "chat", "conversation-synthetic")]
    placed: list[list[GeneratedRequest]] = [[], [], []]
    for request in requests:
        tenant = request.hash_ids[0] % 3                           # a tenant's ids stay its own
        assert {h % 3 for h in request.hash_ids} == {tenant}
        placed[tenant].append(request)
        if request.parent is not None:
            assert requests[request.parent].hash_ids[0] % 3 == tenant
    for tenant, (own, stream) in enumerate(zip(placed, tenants)):
        assert len(own) >= SIZE // 6                               # every tenant has its share
        assert [r.hash_ids for r in own] == [tuple(h * 3 + tenant for h in r.hash_ids)
                                             for r in stream[:len(own)]]  # in its own order


def test_scaling_and_file_round_trip(tmp_path: Path) -> None:
    requests = generate("chat", 30, seed=5)
    path = tmp_path / "chat.jsonl"
    write_trace(requests, path)
    assert json.loads(path.read_text().splitlines()[0])["hash_ids"] == list(requests[0].hash_ids)
    assert read_trace(path, block_tokens=64) == to_records(requests, 64)
    with pytest.raises(ValueError, match="unknown workload"):
        generate("nope")
    with pytest.raises(ValueError, match="at least one request"):
        generate("chat", 0)


def test_sim_command_replays_a_workload(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    code = main(["sim", "--workload", "agent", "--num-requests", "60", "--model-shape", "builtin",
                 "--policies", "hybridserve,marconi", "--snapshot-budgets-gib", "0.002,0.05",
                 "--kv-budgets-gib", "0.05", "--block-size", "16", "--snapshot-interval", "32",
                 "--block-tokens", "16", "--json", str(out), "--no-progress"])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["trace"] == "workload:agent:seed=0" and report["num_requests"] == 60
    assert max(row["token_hit_rate"] for row in report["rows"]) > 0

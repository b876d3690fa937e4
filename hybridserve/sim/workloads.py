"""Generated Mooncake-format workloads for `hybridserve sim --workload NAME`: seeded, deterministic
request streams whose `hash_ids` chains follow the reading rules of `sim/trace.py` (a turn's ids
start with its predecessor's full blocks and it is at least as long as the predecessor's prompt
plus output; shared prefixes are shared ids). Every family (`WORKLOADS`, each function's docstring
says what it models) interleaves many conversations, so reuse distances are long enough for the
snapshot pool to matter.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from hybridserve.sim.trace import TRACE_BLOCK_TOKENS, TraceRecord

__all__ = ["WORKLOADS", "GeneratedRequest", "generate", "to_records", "workload_records", "write_trace"]
DEFAULT_NUM_REQUESTS = 2000
BLOCK = TRACE_BLOCK_TOKENS
SHARED_IDS_START = 1 << 40  # system prompt and document ids, apart from the stream's
REGENERATED_SHARE = 0.2  # turns of `chat-regenerate` that users regenerate


class GeneratedRequest(NamedTuple):
    """One generated request in Mooncake form, with the request it continues (None: a first turn)."""

    timestamp: int  # milliseconds
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    parent: int | None


@dataclass
class _Conversation:
    """The last request of one conversation (what its next turn extends)."""

    hash_ids: tuple[int, ...]
    input_length: int
    output_length: int
    index: int           # position of that request in the stream
    turns_left: int


class _Ids:
    """Fresh hash ids, counting up from `start`."""

    def __init__(self, start: int = 0) -> None:
        self.next = start

    def take(self, count: int) -> tuple[int, ...]:
        """`count` ids never handed out before."""
        ids = tuple(range(self.next, self.next + count))
        self.next += count
        return ids


# A turn is (shared prefix ids, own tokens after it, output tokens) for a first turn, or
# (appended tokens, output tokens) for a continuation.
StartTurn = Callable[[random.Random], tuple[tuple[int, ...], int, int, int]]
NextTurns = Callable[[random.Random, _Conversation], list[tuple[int, int]]]


class _Stream:
    """Builds the request list: first turns and continuations with consistent hash-id chains."""

    def __init__(self, ids: _Ids, interarrival_ms: float, rng: random.Random) -> None:
        self.ids, self.rng, self.interarrival_ms = ids, rng, interarrival_ms
        self.requests: list[GeneratedRequest] = []
        self.clock = 0.0

    def _emit(self, hash_ids: tuple[int, ...], input_length: int, output: int, parent: int | None) -> int:
        self.clock += self.rng.expovariate(1.0 / self.interarrival_ms)
        self.requests.append(GeneratedRequest(int(self.clock), input_length, output, hash_ids, parent))
        return len(self.requests) - 1

    def first(self, prefix: tuple[int, ...], own_tokens: int, output: int, turns: int) -> _Conversation:
        """A first turn: `prefix` (whole shared blocks) then `own_tokens` of its own (>= one block,
        so its full blocks name it alone and its next turn finds it)."""
        own_tokens = max(own_tokens, BLOCK)
        input_length = len(prefix) * BLOCK + own_tokens
        hash_ids = prefix + self.ids.take(math.ceil(own_tokens / BLOCK))
        index = self._emit(hash_ids, input_length, output, None)
        return _Conversation(hash_ids, input_length, output, index, turns)

    def extend(self, conversation: _Conversation, appended: int, output: int) -> _Conversation:
        """The next turn: the conversation so far (prompt + output) plus `appended` new tokens; it
        ends past another block boundary, so sibling continuations keep distinct full blocks."""
        base = conversation.input_length + conversation.output_length
        appended = max(appended, (conversation.input_length // BLOCK + 1) * BLOCK - base + 1, 1)
        input_length = base + appended
        full = conversation.hash_ids[:conversation.input_length // BLOCK]
        hash_ids = full + self.ids.take(math.ceil(input_length / BLOCK) - len(full))
        index = self._emit(hash_ids, input_length, output, conversation.index)
        return _Conversation(hash_ids, input_length, output, index, conversation.turns_left - 1)


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(max(rng.lognormvariate(math.log(median), sigma), low), high))


def _interleave(num_requests: int, seed: int, interarrival_ms: float, start: StartTurn, next_turns: NextTurns,
                gap: Callable[[random.Random], float]) -> list[GeneratedRequest]:
    """Run conversations side by side: each turn schedules the next one `gap` requests later (a
    continuation due now goes first, else a new conversation starts). `next_turns` returns one or
    more continuations of the same state (a branch); the conversation goes on from the last."""
    rng = random.Random(seed)
    ids = _Ids()
    stream = _Stream(ids, interarrival_ms, rng)
    due: list[tuple[float, int, _Conversation]] = []
    order = 0
    while len(stream.requests) < num_requests:
        if due and due[0][0] <= len(stream.requests):
            _, _, parent = heapq.heappop(due)
            branch = next_turns(rng, parent)[:num_requests - len(stream.requests)]
            conversation = [stream.extend(parent, appended, output) for appended, output in branch][-1]
        else:
            prefix, own, output, turns = start(rng)
            conversation = stream.first(prefix, own, output, turns)
        if conversation.turns_left > 0:
            order += 1
            heapq.heappush(due, (len(stream.requests) + gap(rng), order, conversation))
    return stream.requests


def _system_prompts(ids: _Ids, rng: random.Random, count: int, low_blocks: int, high_blocks: int
                    ) -> list[tuple[int, ...]]:
    return [ids.take(rng.randint(low_blocks, high_blocks)) for _ in range(count)]


def _zipf_choice(rng: random.Random, items: list[tuple[int, ...]], exponent: float = 1.0) -> tuple[int, ...]:
    weights = [1.0 / (rank + 1) ** exponent for rank in range(len(items))]
    return rng.choices(items, weights)[0]


def agent(num_requests: int, seed: int) -> list[GeneratedRequest]:
    """Tool-use agents: 4 shared system prompts (tool specs), ~200 live sessions, turns of a short
    tool call plus a tool result, and one turn in six a branch of 2-4 continuations."""
    setup = random.Random(seed ^ 0xA6E7)
    prompts_ids = _Ids(SHARED_IDS_START)
    prompts = _system_prompts(prompts_ids, setup, 4, 4, 12)
    sessions = setup.randint(150, 260)

    def start(rng: random.Random) -> tuple[tuple[int, ...], int, int, int]:
        turns = min(int(rng.expovariate(1 / 9)) + 2, 40)
        return _zipf_choice(rng, prompts), _lognormal(rng, 1200, 0.6, 512, 6000), _lognormal(rng, 120, 0.7, 8, 800), \
            turns

    def next_turns(rng: random.Random, conversation: _Conversation) -> list[tuple[int, int]]:
        width = rng.randint(2, 4) if rng.random() < 1 / 6 else 1
        return [(conversation.output_length + _lognormal(rng, 1100, 0.8, 200, 8000),
                 _lognormal(rng, 120, 0.7, 8, 800)) for _ in range(width)]

    return _interleave(num_requests, seed, 40.0, start, next_turns, lambda rng: rng.uniform(0.5, 1.5) * sessions)


def chat(num_requests: int, seed: int) -> list[GeneratedRequest]:
    """Multi-turn chat: 3 shared system prompts, ~400 conversations open at once, 2-12 turns each,
    short user messages and answers of a few hundred tokens."""
    return _chat(num_requests, seed, regenerate=False)


def chat_regenerate(num_requests: int, seed: int) -> list[GeneratedRequest]:
    """`chat` where users regenerate answers: a share REGENERATED_SHARE of the later turns comes 2-3
    times, each a sibling continuation of the same conversation state (the conversation goes on from
    the last)."""
    return _chat(num_requests, seed, regenerate=True)


def _chat(num_requests: int, seed: int, regenerate: bool) -> list[GeneratedRequest]:
    setup = random.Random(seed ^ 0xC4A7)
    prompts_ids = _Ids(SHARED_IDS_START)
    prompts = _system_prompts(prompts_ids, setup, 3, 2, 6)
    open_conversations = setup.randint(250, 500)

    def start(rng: random.Random) -> tuple[tuple[int, ...], int, int, int]:
        turns = min(int(rng.expovariate(1 / 4)) + 1, 11)
        return _zipf_choice(rng, prompts, 0.5), _lognormal(rng, 700, 0.6, 512, 8000), \
            _lognormal(rng, 300, 0.8, 10, 2000), turns

    def next_turns(rng: random.Random, conversation: _Conversation) -> list[tuple[int, int]]:
        width = rng.randint(2, 3) if regenerate and rng.random() < REGENERATED_SHARE else 1
        return [(_lognormal(rng, 150, 1.0, 5, 4000), _lognormal(rng, 300, 0.8, 10, 2000)) for _ in range(width)]

    return _interleave(num_requests, seed, 200.0, start, next_turns,
                       lambda rng: rng.expovariate(1 / open_conversations))


def conversation_synthetic(num_requests: int, seed: int) -> list[GeneratedRequest]:
    """An unseen variant of the Mooncake conversation trace: one system block shared by all, a
    Zipf-popular set of long shared documents opening some first turns, long first prompts,
    heavy-tailed reuse distances. The seed perturbs every parameter around the trace's scale, so
    each seed is a different trace."""
    setup = random.Random(seed ^ 0x5E7C)
    prompts_ids = _Ids(SHARED_IDS_START)
    system = prompts_ids.take(1)
    documents = [system + prompts_ids.take(setup.randint(1, 24)) for _ in range(setup.randint(30, 120))]
    document_share = setup.uniform(0.1, 0.3)
    first_median, output_median = setup.uniform(6000, 14000), setup.uniform(150, 400)
    turn_mean, gap_median, gap_sigma = setup.uniform(0.2, 0.6), setup.uniform(150, 600), setup.uniform(0.6, 1.4)

    def start(rng: random.Random) -> tuple[tuple[int, ...], int, int, int]:
        prefix = _zipf_choice(rng, documents, 0.8) if rng.random() < document_share else system
        turns = int(rng.expovariate(1 / turn_mean)) if turn_mean else 0
        return prefix, _lognormal(rng, first_median, 0.9, 512, 120_000), \
            _lognormal(rng, output_median, 1.0, 1, 2000), min(turns, 12)

    def next_turns(rng: random.Random, conversation: _Conversation) -> list[tuple[int, int]]:
        return [(_lognormal(rng, 400, 1.2, 5, 20_000), _lognormal(rng, output_median, 1.0, 1, 2000))]

    return _interleave(num_requests, seed, 80.0, start, next_turns,
                       lambda rng: rng.lognormvariate(math.log(gap_median), gap_sigma))


MIXED_TENANTS = (agent, chat, conversation_synthetic)
MIXED_INTERARRIVAL_MS = 60.0


def mixed(num_requests: int, seed: int) -> list[GeneratedRequest]:
    """One server shared by the other families at once: an agent, a chat and a document-conversation
    tenant (each its own seeded stream), their requests drawn in a seeded random order with a share
    per tenant that the seed sets. Each tenant keeps its own order and ids (none shared across
    tenants), so its reuse distances stretch with the others' traffic and a candidate kind is worth
    a different amount in each tenant's requests."""
    setup = random.Random(seed ^ 0x313D)
    shares = [setup.uniform(0.5, 1.5) for _ in MIXED_TENANTS]
    streams = [tenant(num_requests, seed) for tenant in MIXED_TENANTS]
    placed: list[list[int]] = [[] for _ in MIXED_TENANTS]  # tenant -> its requests' indices here
    rng, clock = random.Random(seed), 0.0
    requests: list[GeneratedRequest] = []
    while len(requests) < num_requests:
        tenant = rng.choices(range(len(MIXED_TENANTS)), shares)[0]
        own = streams[tenant][len(placed[tenant])]
        clock += rng.expovariate(1.0 / MIXED_INTERARRIVAL_MS)
        parent = None if own.parent is None else placed[tenant][own.parent]
        hash_ids = tuple(h * len(MIXED_TENANTS) + tenant for h in own.hash_ids)
        placed[tenant].append(len(requests))
        requests.append(GeneratedRequest(int(clock), own.input_length, own.output_length, hash_ids, parent))
    return requests


WORKLOADS: dict[str, Callable[[int, int], list[GeneratedRequest]]] = {
    "agent": agent, "chat": chat, "chat-regenerate": chat_regenerate, "conversation-synthetic": conversation_synthetic,
    "mixed": mixed}


def generate(name: str, num_requests: int | None = None, seed: int = 0) -> list[GeneratedRequest]:
    """The first `num_requests` (default DEFAULT_NUM_REQUESTS) requests of workload `name`."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    count = DEFAULT_NUM_REQUESTS if num_requests is None else num_requests
    if count < 1:
        raise ValueError(f"a workload needs at least one request, got {count}")
    return WORKLOADS[name](count, seed)


def to_records(requests: list[GeneratedRequest], block_tokens: int = TRACE_BLOCK_TOKENS) -> list[TraceRecord]:
    """Trace records with lengths scaled to `block_tokens` per hash block, as `read_trace` scales."""
    if not 1 <= block_tokens <= TRACE_BLOCK_TOKENS:
        raise ValueError(f"block_tokens must be in [1, {TRACE_BLOCK_TOKENS}], got {block_tokens}")
    scale = block_tokens / TRACE_BLOCK_TOKENS
    return [TraceRecord(float(r.timestamp), max(1, math.ceil(r.input_length * scale)),
                        max(1, math.ceil(r.output_length * scale)), r.hash_ids) for r in requests]


def workload_records(name: str, num_requests: int | None, block_tokens: int, seed: int = 0) -> list[TraceRecord]:
    """Records of a generated workload, ready for `TraceTokens`."""
    return to_records(generate(name, num_requests, seed), block_tokens)


def write_trace(requests: list[GeneratedRequest], path: str | Path) -> None:
    """Write `requests` as a Mooncake-format JSONL trace (replayable with `--trace` or `bench trace`)."""
    lines = (json.dumps({"timestamp": r.timestamp, "input_length": r.input_length, "output_length": r.output_length,
                         "hash_ids": list(r.hash_ids)}) + "\n" for r in requests)
    Path(path).write_text("".join(lines), encoding="utf-8")

"""Mooncake-format request traces (`hash_ids`: one id per 512-token block), turned into token ids:
each hash id is a fixed pseudo-random block, so equal id prefixes give equal token prefixes. A
request whose first k >= 2 ids are exactly an earlier request P's full blocks, and which is at
least as long as P's prompt plus output, is P's next turn: its prompt starts with P's prompt and
output. Not when P's full blocks are a shared prompt and no more: P added no full block of its own
and SHARED_PROMPT_BRANCHES or more different blocks have followed them (a tool prompt that hundreds
of unrelated requests open with), since then nothing in the ids tells P's next turn from a sibling
that happens to be longer. Outputs are synthetic unless a live replay supplies them
(`TraceTokens.set_output`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np

TRACE_BLOCK_TOKENS = 512
FIRST_TOKEN_ID = 300  # stay clear of byte and special ids of small tokenizers
SHARED_PROMPT_BRANCHES = 8  # different next blocks after which a full-block prefix is a shared prompt


class TraceRecord(NamedTuple):
    """One request of a trace (lengths already scaled)."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def default_trace_path() -> Path:
    """`../shared/traces/mooncake_conversation.jsonl` next to the repository root."""
    return Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "mooncake_conversation.jsonl"


def read_trace(path: str | Path, limit: int | None = None, block_tokens: int = TRACE_BLOCK_TOKENS,
               max_output_tokens: int | None = None) -> list[TraceRecord]:
    """Records of a Mooncake-format JSONL trace, lengths scaled to `block_tokens` per hash block.
    Raises ValueError naming the file and line for anything malformed."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace file {str(path)!r} does not exist (see ../shared/traces/README.md)")
    if not 1 <= block_tokens <= TRACE_BLOCK_TOKENS:
        raise ValueError(f"block_tokens must be in [1, {TRACE_BLOCK_TOKENS}], got {block_tokens}")
    records: list[TraceRecord] = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if limit is not None and len(records) >= limit:
                break
            if line.strip():
                records.append(_parse(line, f"{path}:{number}", block_tokens, max_output_tokens))
    if not records:
        raise ValueError(f"trace file {str(path)!r} holds no requests")
    return records


def _parse(line: str, where: str, block_tokens: int, max_output_tokens: int | None) -> TraceRecord:
    try:
        raw = json.loads(line)
        hash_ids = tuple(int(h) for h in raw["hash_ids"])
        input_length, output_length = int(raw["input_length"]), int(raw["output_length"])
        timestamp = float(raw.get("timestamp", 0))
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{where}: not a Mooncake trace record ({error})") from None
    if input_length < 1 or output_length < 0 or not hash_ids:
        raise ValueError(f"{where}: needs input_length >= 1, output_length >= 0 and hash_ids")
    if math.ceil(input_length / TRACE_BLOCK_TOKENS) > len(hash_ids):
        raise ValueError(f"{where}: {len(hash_ids)} hash ids cannot cover {input_length} tokens")
    scale = block_tokens / TRACE_BLOCK_TOKENS
    output = max(1, math.ceil(output_length * scale))
    if max_output_tokens is not None:
        output = min(output, max_output_tokens)
    return TraceRecord(timestamp, max(1, math.ceil(input_length * scale)), output, hash_ids)


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a fast, well-spread hash of uint64 values."""
    z = values + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def pseudo_random_tokens(seed: int | list[int], count: int, vocab_size: int) -> np.ndarray:
    """`count` token ids in [FIRST_TOKEN_ID, vocab_size) fixed by `seed` (a list of seeds gives
    one row per seed)."""
    seeds = np.asarray(seed, dtype=np.uint64) & np.uint64(0xFFFFFFFF)
    with np.errstate(over="ignore"):
        keys = (seeds[..., None] << np.uint64(24)) | np.arange(count, dtype=np.uint64)
        return (_mix(keys) % np.uint64(vocab_size - FIRST_TOKEN_ID)).astype(np.int32) + FIRST_TOKEN_ID


class TraceTokens:
    """Prompt and output token ids of each record of a trace, built in trace order."""

    def __init__(self, records: list[TraceRecord], block_tokens: int, vocab_size: int) -> None:
        if vocab_size <= FIRST_TOKEN_ID + 1:
            raise ValueError(f"vocab_size must exceed {FIRST_TOKEN_ID + 1}")
        self.records = records
        self.block_tokens = block_tokens
        self.vocab_size = vocab_size
        self._blocks: dict[int, np.ndarray] = {}          # hash id -> its tokens (as first seen)
        self._by_full_blocks: dict[tuple[int, ...], int] = {}  # full-block ids -> latest request
        self._prompts: dict[int, np.ndarray] = {}
        self._outputs: dict[int, np.ndarray] = {}
        self._predecessors: dict[int, int | None] = {}
        self._adds_full_block: dict[int, bool] = {}        # request -> a full block of its own ids
        self._next_ids: dict[tuple[int, ...], set[int]] = {}  # registered full blocks -> ids seen next

    def predecessor(self, index: int) -> int | None:
        """The earlier request this one continues (see the module docstring), or None."""
        if index not in self._predecessors:
            self._predecessors[index] = self._find_predecessor(index)
        return self._predecessors[index]

    def _find_predecessor(self, index: int) -> int | None:
        record = self.records[index]
        for depth in range(len(record.hash_ids), 1, -1):
            earlier = self._by_full_blocks.get(record.hash_ids[:depth])
            if earlier is not None and earlier in self._outputs and not self._only_shared(earlier, depth):
                previous = self.records[earlier]
                if record.input_length >= previous.input_length + previous.output_length:
                    return earlier
        return None

    def _only_shared(self, earlier: int, depth: int) -> bool:
        """Whether `earlier`'s full blocks (its first `depth` ids) are a shared prompt it added
        nothing to (see the module docstring)."""
        branches = self._next_ids.get(self.records[earlier].hash_ids[:depth], ())
        return not self._adds_full_block[earlier] and len(branches) >= SHARED_PROMPT_BRANCHES

    def prompt(self, index: int) -> list[int]:
        """Prompt token ids of request `index`; every earlier request must have been built."""
        if index not in self._prompts:
            self._prompts[index] = self._build_prompt(index)
        prompt: list[int] = self._prompts[index].tolist()
        return prompt

    def output(self, index: int) -> list[int]:
        """Output token ids of request `index` (synthetic unless `set_output` gave them)."""
        if index not in self._outputs:
            record = self.records[index]
            self.set_output(index, pseudo_random_tokens(0x7F000000 + index, record.output_length,
                                                        self.vocab_size).tolist())
        output: list[int] = self._outputs[index].tolist()
        return output

    def has_output(self, index: int) -> bool:
        """Whether request `index`'s output tokens are known."""
        return index in self._outputs

    def set_output(self, index: int, token_ids: list[int]) -> None:
        """Record what request `index` generated (its successors' prompts start with it)."""
        self._outputs[index] = np.asarray(token_ids, dtype=np.int32)

    def _build_prompt(self, index: int) -> np.ndarray:
        record, size = self.records[index], self.block_tokens
        history = None
        earlier = self.predecessor(index)
        if earlier is not None:
            history = np.concatenate([self._prompts[earlier], self._outputs[earlier]])
        tokens = np.empty(len(record.hash_ids) * size, dtype=np.int32)
        new = [h for h in record.hash_ids if h not in self._blocks]
        fresh = dict(zip(new, pseudo_random_tokens(new, size, self.vocab_size))) if new else {}
        for position, hash_id in enumerate(record.hash_ids):
            block = self._blocks.get(hash_id)
            if block is None:
                block = fresh[hash_id]
                if history is not None and position * size < len(history):
                    known = history[position * size:(position + 1) * size]
                    block[:len(known)] = known
                self._blocks[hash_id] = block
            tokens[position * size:(position + 1) * size] = block
        full = record.input_length // size
        unseen = set(new)  # ids no earlier request had: where this one's own content starts
        shared = next((position for position, hash_id in enumerate(record.hash_ids) if hash_id in unseen),
                      len(record.hash_ids))
        self._note_ids(index, full, shared)
        self._by_full_blocks[record.hash_ids[:full]] = index
        return tokens[:record.input_length]

    def _note_ids(self, index: int, full: int, shared: int) -> None:
        """Count request `index`'s next block after each registered full-block prefix it starts
        with, and whether its `full` blocks go beyond its first `shared` ids, which earlier requests had."""
        ids = self.records[index].hash_ids
        for depth in range(1, len(ids)):
            branches = self._next_ids.get(ids[:depth])
            if branches is not None:
                branches.add(ids[depth])
        self._adds_full_block[index] = full > shared
        self._next_ids.setdefault(ids[:full], set())

"""`benchmarks.replay_floor`'s suffix replay: each prompt without the tokens its hit restored."""

from __future__ import annotations

from benchmarks.replay_floor import _Suffixes
from hybridserve.sim.trace import TraceRecord, TraceTokens


def test_suffixes_drop_each_prompts_hit_and_keep_the_records() -> None:
    records = [TraceRecord(0.0, 48, 2, (1, 2, 3)), TraceRecord(1.0, 64, 3, (1, 2, 3, 4))]
    tokens = TraceTokens(records, 16, vocab_size=1000)
    suffixes = _Suffixes(tokens, [0, 40])
    assert suffixes.prompt(0) == tokens.prompt(0)
    assert suffixes.prompt(1) == tokens.prompt(1)[40:] and len(suffixes.prompt(1)) == 24
    assert suffixes.records is records and suffixes.has_output(1)

"""`hybridserve bench chat`: interleaved multi-turn conversations, cache on vs off.
Each turn appends a random user message and the greedy reply to its history; conversations take
turns round-robin, one request at a time, both engines serving each turn back to back.
"""

from __future__ import annotations

from typing import Any

from hybridserve.bench import common
from hybridserve.bench.configs import ChatBenchConfig
from hybridserve.config import EngineConfig
from hybridserve.engine.engine import LLMEngine
from hybridserve.sim.trace import pseudo_random_tokens

TTFT_RATIO_GOAL = 0.2  # warm turns past 2k tokens: cache-on p50 TTFT at most 0.2x cache-off


def run_chat_bench(engine_config: EngineConfig, cfg: ChatBenchConfig) -> dict[str, Any]:
    """Play the conversations on a cache-on and a cache-off engine; TTFT per turn for each."""
    engines = dict(zip(("on", "off"), (LLMEngine(config) for config in common.cache_on_off(engine_config))))
    drivers = {label: common.EngineDriver(engine, label) for label, engine in engines.items()}
    vocab = engines["on"].model_config.vocab_size

    def fresh(seed: int, count: int) -> list[int]:
        tokens: list[int] = pseudo_random_tokens(seed, count, vocab).tolist()
        return tokens

    histories = [fresh(cfg.seed * 1000 + c, cfg.system_tokens) for c in range(cfg.conversations)]
    rows = []
    for turn in range(cfg.turns):
        for conversation, history in enumerate(histories):
            prompt = history + fresh(cfg.seed * 1000 + 100 * (turn + 1) + conversation, cfg.message_tokens)
            results = {label: drivers[label].run(prompt, common.greedy(cfg.reply_tokens))
                       for label in common.alternate(["on", "off"], turn + conversation)}
            reply = results["on"].output.outputs[0].token_ids
            assert reply == results["off"].output.outputs[0].token_ids, "cache on and off generated different replies"
            rows.append({"turn": turn + 1, "conversation": conversation, "prompt_tokens": len(prompt),
                         "previous_history": len(history), "cached_tokens": results["on"].output.num_cached_tokens,
                         "ttft_on_s": results["on"].ttft_s, "ttft_off_s": results["off"].ttft_s})
            history.extend(prompt[len(history):] + reply)
    common.finish(*engines.values())
    return common.result_header(cfg, engines["on"]) | {"rows": rows, "summary": _summary(rows, cfg)}


def _summary(rows: list[dict[str, Any]], cfg: ChatBenchConfig) -> dict[str, Any]:
    later = [r for r in rows if r["turn"] >= 2]
    long = [r for r in later if r["prompt_tokens"] > cfg.long_after_tokens]
    ends_hit = sum(r["cached_tokens"] == r["previous_history"] - 1 for r in later)

    def ratio(selected: list[dict[str, Any]]) -> float | None:
        if not selected:
            return None
        return common.median(r["ttft_on_s"] for r in selected) / common.median(r["ttft_off_s"] for r in selected)

    return {"turns_after_first": len(later), "turns_hitting_previous_end": ends_hit,
            "p50_ratio_turns_2plus": ratio(later), "long_turns": len(long), "p50_ratio_long": ratio(long),
            "p50_ttft_on_long_ms": 1000 * common.median(r["ttft_on_s"] for r in long) if long else None,
            "p50_ttft_off_long_ms": 1000 * common.median(r["ttft_off_s"] for r in long) if long else None}


def format_chat_report(result: dict[str, Any]) -> str:
    """The table printed by `bench chat`."""
    cfg, summary = result["config"], result["summary"]
    by_turn: dict[int, list[dict[str, Any]]] = {}
    for row in result["rows"]:
        by_turn.setdefault(row["turn"], []).append(row)
    table_rows = []
    for turn, rows in sorted(by_turn.items()):
        prompt, cached, on, off = (common.median(r[key] for r in rows)
                                   for key in ("prompt_tokens", "cached_tokens", "ttft_on_s", "ttft_off_s"))
        table_rows.append([turn, int(prompt), int(cached), f"{1000 * on:.1f}", f"{1000 * off:.1f}", f"{on / off:.3f}"])
    table = common.format_table(
        ["turn", "prompt tokens (median)", "cached (median)", "TTFT on ms", "TTFT off ms", "on/off"], table_rows)
    long_ratio = summary["p50_ratio_long"]
    verdict = "-" if long_ratio is None else ("met" if long_ratio <= TTFT_RATIO_GOAL else "NOT MET")
    return "\n".join([
        f"{cfg['conversations']} interleaved conversations x {cfg['turns']} turns: system {cfg['system_tokens']} "
        f"tokens, +{cfg['message_tokens']} user tokens and a {cfg['reply_tokens']}-token greedy reply per turn",
        table,
        f"turns >= 2 that restored exactly the previous turn's end (history - 1 tokens): "
        f"{summary['turns_hitting_previous_end']}/{summary['turns_after_first']}",
        f"p50 TTFT on/off, turns >= 2 past {cfg['long_after_tokens']} tokens ({summary['long_turns']} turns): "
        + ("-" if long_ratio is None else f"{long_ratio:.3f} ({summary['p50_ttft_on_long_ms']:.1f} vs "
           f"{summary['p50_ttft_off_long_ms']:.1f} ms; goal <= {TTFT_RATIO_GOAL}: {verdict})"),
        f"engine (on): {result['engine']}\nmachine: {result['machine']}",
    ])

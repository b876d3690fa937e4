"""`python -m benchmarks.replicas_chat`: interleaved multi-turn conversations against engine replicas on
a local Ray Serve cluster (issue 38): 2 replicas routed by joint-cache hits, the same 2 replicas routed
round-robin, and one replica with the same total cache (each pool twice as large). Every setup serves
the same conversations through the OpenAI chat endpoint; the figure of merit is the prompt tokens
served from the cache (`usage.prompt_tokens_details.cached_tokens`), and the goal is joint routing at
>= 0.95x the hit tokens of one replica.

Conversations run concurrently (each one turn at a time, `--concurrency` at once), so turns of
different conversations interleave and the router sees real load; each turn appends `--message-tokens`
of user text to the history and a greedy `--reply-tokens` reply. The built-in model unless `--model`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
from typing import Any

import httpx

from hybridserve.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridserve.models.builtin import builtin_tokenizer
from hybridserve.sim.trace import pseudo_random_tokens

GOAL = 0.95  # joint routing's hit tokens over one replica's with the same total cache
SETUPS = (("joint", 2, "joint"), ("round-robin", 2, "round-robin"), ("one replica", 1, "joint"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _engine_config(args: argparse.Namespace, pool_scale: int) -> EngineConfig:
    """Each replica's engine; `pool_scale` multiplies both cache pools (one replica holds the total)."""
    cache = CacheConfig(kv_cache_mib=args.kv_cache_mib * pool_scale,
                        prefix_cache_mib=args.prefix_cache_mib * pool_scale, block_size=16)
    return EngineConfig(model=args.model, device="cpu", dtype="float32", num_threads=1, cache=cache,
                        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048))


def _user_texts(args: argparse.Namespace) -> list[list[str]]:
    """The user message of every turn of every conversation (the same for every setup)."""
    tokenizer = builtin_tokenizer()
    vocab = 4096

    def text(seed: int) -> str:
        ids = (pseudo_random_tokens(seed, args.message_tokens, vocab - 300) + 300).tolist()
        return str(tokenizer.decode(ids))

    return [[text(args.seed * 10_000 + 100 * c + t) for t in range(args.turns)] for c in range(args.conversations)]


async def _conversation(client: httpx.AsyncClient, url: str, turns: list[str], reply_tokens: int,
                        gate: asyncio.Semaphore) -> list[dict[str, int]]:
    messages: list[dict[str, str]] = []
    rows = []
    for turn, user in enumerate(turns):
        messages.append({"role": "user", "content": user})
        body = {"model": "bench", "messages": messages, "max_tokens": reply_tokens, "temperature": 0,
                "ignore_eos": True}
        async with gate:
            response = await client.post(f"{url}/v1/chat/completions", json=body)
        response.raise_for_status()
        answer = response.json()
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        usage = answer["usage"]
        rows.append({"turn": turn, "prompt_tokens": usage["prompt_tokens"],
                     "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]})
    return rows


async def _play(url: str, texts: list[list[str]], args: argparse.Namespace) -> list[dict[str, int]]:
    gate = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        results = await asyncio.gather(*(_conversation(client, url, turns, args.reply_tokens, gate)
                                         for turns in texts))
    return [row for rows in results for row in rows]


def _decisions(url: str) -> dict[str, int]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    prefix = "hybridserve_router_decisions_total{reason=\""
    return {line[len(prefix):].split('"')[0]: int(float(line.rsplit(" ", 1)[1]))
            for line in text.splitlines() if line.startswith(prefix)}


def run_setup(name: str, replicas: int, router: str, args: argparse.Namespace,
              texts: list[list[str]]) -> dict[str, Any]:
    """Deploy one setup, play every conversation against it, take it down; its figures."""
    from ray import serve

    from hybridserve.replicas import build_app

    config = _engine_config(args, pool_scale=3 - replicas)
    app = build_app(config, num_replicas=replicas, model_name="bench", router=router, stats_period_s=0.5)
    serve.run(app, name="bench", route_prefix="/")
    url = f"http://127.0.0.1:{args.port}"
    start = time.perf_counter()
    rows = asyncio.run(_play(url, texts, args))
    wall = time.perf_counter() - start
    decisions = _decisions(url) if router == "joint" else {}
    serve.delete("bench")
    prompt = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r["cached_tokens"] for r in rows)
    return {"setup": name, "replicas": replicas, "router": router, "requests": len(rows), "prompt_tokens": prompt,
            "hit_tokens": cached, "hit_share": cached / prompt if prompt else 0.0, "wall_s": wall,
            "decisions": decisions}


def format_report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The table printed at the end, with the goal's verdict."""
    one = next(r for r in results if r["setup"] == "one replica")["hit_tokens"]
    lines = [f"{args.conversations} conversations x {args.turns} turns (+{args.message_tokens} user tokens, "
             f"{args.reply_tokens}-token replies), concurrency {args.concurrency}; per-replica pools: KV "
             f"{args.kv_cache_mib} MiB, snapshots {args.prefix_cache_mib} MiB (one replica: twice each)",
             f"{'setup':<12} {'requests':>8} {'prompt tok':>10} {'hit tok':>8} {'hit share':>9} "
             f"{'vs one':>7} {'wall s':>7}  decisions"]
    for r in results:
        ratio = r["hit_tokens"] / one if one else 0.0
        lines.append(f"{r['setup']:<12} {r['requests']:>8} {r['prompt_tokens']:>10} {r['hit_tokens']:>8} "
                     f"{r['hit_share']:>9.3f} {ratio:>7.3f} {r['wall_s']:>7.1f}  {r['decisions'] or ''}")
    joint = next(r for r in results if r["setup"] == "joint")["hit_tokens"]
    ratio = joint / one if one else 0.0
    verdict = "met" if ratio >= GOAL else "NOT MET"
    lines.append(f"joint / one replica hit tokens: {ratio:.3f} (goal >= {GOAL}: {verdict})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run every setup on a local Ray instance and print the table (`--json`: also save it)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replicas_chat", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--message-tokens", type=int, default=150)
    parser.add_argument("--reply-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--kv-cache-mib", type=float, default=16.0, help="per replica (one replica: twice)")
    parser.add_argument("--prefix-cache-mib", type=float, default=16.0, help="per replica (one replica: twice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    args.port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    texts = _user_texts(args)
    try:
        results = [run_setup(name, replicas, router, args, texts) for name, replicas, router in SETUPS]
    finally:
        serve.shutdown()
        ray.shutdown()
    print(format_report(results, args))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"config": {k: v for k, v in vars(args).items() if k != "json"}, "results": results}, out,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


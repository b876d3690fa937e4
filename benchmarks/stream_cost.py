"""`python -m benchmarks.stream_cost`: CPU time the API process spends per streamed token, for a
short and a long stream (issue 36's goal: per-token cost at 8k within 1.2x of that at 512).

It starts `hybridserve serve` (the built-in model unless `--model`), whose engine core runs in a
child process, and streams completions with `ignore_eos` from this process. The API process's own
CPU time (user + system of all its threads, not its children) is read from /proc before and after
each stream; the core's forward passes are not in it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import httpx

from hybridserve.bench.serve_client import ServerProcess

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (its threads, not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14 and 15)


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def stream_tokens(client: httpx.Client, url: str, model: str, tokens: int, chat_tools: bool) -> tuple[int, int]:
    """Stream one completion of exactly `tokens` tokens; (tokens reported by usage, events read).
    `chat_tools`: a chat completion with a tool offered (`tool_choice` auto), so every chunk goes
    through the tool-call parser."""
    body: dict[str, object] = {"model": model, "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
                               "stream": True, "stream_options": {"include_usage": True}}
    if chat_tools:
        body.update(messages=[{"role": "user", "content": "Count on."}], tools=[TOOL])
    else:
        body["prompt"] = "Count on:"
    route = "chat/completions" if chat_tools else "completions"
    events, used = 0, 0
    with client.stream("POST", f"{url}/v1/{route}", json=body, timeout=None) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events += 1
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                used = chunk["usage"]["completion_tokens"]
    return used, events


def measure(args: argparse.Namespace) -> dict[str, object]:
    """Run the server and the streams; the per-token CPU of each length and their ratio."""
    longest = max(args.lengths)
    serve_args = ["--served-model-name", "m", "--max-model-len", str(longest + 1024), "--device", "cpu",
                  *args.serve_args, *(["--model", args.model] if args.model else [])]
    per_token: dict[int, list[float]] = {length: [] for length in args.lengths}
    with ServerProcess(serve_args, start_timeout_s=args.start_timeout_s) as server, httpx.Client() as client:
        assert server.proc is not None
        pid = server.proc.pid
        stream_tokens(client, server.url, "m", 16, args.chat_tools)  # warm-up: first-request paths out of the way
        for _ in range(args.rounds):
            for length in args.lengths:
                before = process_cpu_s(pid)
                used, events = stream_tokens(client, server.url, "m", length, args.chat_tools)
                spent = process_cpu_s(pid) - before
                if used != length:
                    raise RuntimeError(f"asked for {length} tokens, got {used}")
                per_token[length].append(spent / length)
                print(f"{length:>6} tokens: {spent:.3f} CPU s in the API process, "
                      f"{1e6 * spent / length:.1f} us/token ({events} events)", flush=True)
    medians = {length: statistics.median(values) for length, values in per_token.items()}
    shortest = min(args.lengths)
    return {"us_per_token": {length: round(1e6 * value, 2) for length, value in medians.items()},
            "ratio_longest_to_shortest": round(medians[longest] / medians[shortest], 3),
            "rounds": args.rounds, "route": "chat with tools" if args.chat_tools else "completions",
            "command": "hybridserve serve " + " ".join(serve_args)}


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 8192], help="streamed tokens per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per length (the median is reported)")
    parser.add_argument("--chat-tools", action="store_true", help="stream chat completions with a tool offered")
    parser.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="more `hybridserve serve` flags, after --")
    args = parser.parse_args()
    args.serve_args = [a for a in args.serve_args if a != "--"]
    print(json.dumps(measure(args), indent=2))


if __name__ == "__main__":
    main()

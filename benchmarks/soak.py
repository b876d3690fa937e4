"""`python -m benchmarks.soak`: mixed random traffic against a live server for a fixed time.

A `hybridserve serve` subprocess (or `--url`) gets, from several clients, a random mix of streamed
and plain completions and chats, shared prefixes, aborts, client disconnects and bad requests, plus
periodic bursts larger than its queue (503 expected there and only there), while the resident
memory of its processes is sampled. Pass (`result["passed"]`): no unexpected 5xx/503, no valid request
answered 4xx nor bad one 2xx, no stream error event, every pool free again once idle, and the
server's resident memory (gross: every byte its processes hold) growing under 5% from the second
window to the last. Growth net of the free memory the engine's allocator keeps is reported too.

With `--adversarial-share S`, the bad requests leave the normal mix and an adversary runs in every
other phase (`--adversary-phase` seconds): there, a share S of the requests are hostile (the bad
ones plus ids past int64, bodies past the size limit, deep nesting, wrong types, too many stops or
prompts, schemas that do not compile). The report compares the streamed TTFT p99 of the
well-behaved requests in the adversary's phases with the quiet phases (outside overload bursts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from hybridserve.bench.common import FIRST_PLAIN_ID, KEEPALIVE_EXPIRY_S, PLAIN_ID_SPAN, write_json
from hybridserve.bench.configs import add_config_arguments, config_from_args, option, seed_option
from hybridserve.bench.serve_client import ServerProcess, percentile


@dataclass(frozen=True)
class SoakConfig:
    """Sizes of the soak (token counts are prompt token ids)."""

    duration_s: float = option(300.0, "seconds of traffic", flag="--duration")
    clients: int = option(6, "concurrent clients")
    overload_every_s: float = option(45.0, "seconds between overload bursts", flag="--overload-every")
    overload_burst: int = option(40, "requests sent at once in a burst")
    short_prompt_tokens: tuple[int, int] = (4, 64)
    long_prompt_tokens: int = 1500
    shared_prefixes: int = 3
    shared_prefix_tokens: int = 512
    max_tokens: tuple[int, int] = (1, 24)
    rss_interval_s: float = 2.0
    rss_window_s: float = option(60.0, "RSS growth compares the mean of the last window with the second one",
                                 flag="--rss-window")
    request_timeout_s: float = 120.0
    idle_timeout_s: float = 60.0
    warmup_long_prompts: int = 8
    adversarial_share: float = option(0.0, "share of requests that are hostile in the adversary's phases (then the "
                                      "bad kind leaves the normal mix)", flag="--adversarial-share")
    adversary_phase_s: float = option(90.0, "the adversary runs in every other phase of this many seconds",
                                      flag="--adversary-phase")
    seed: int = seed_option("the traffic")


KINDS = ("complete", "stream", "chat", "long", "shared", "abort", "disconnect", "bad")
WEIGHTS = (3, 3, 2, 1, 3, 1, 1, 1)
REFUSED_KINDS = ("bad", "hostile")  # requests the server must answer with a 4xx


@dataclass
class SoakStats:
    """Counters and samples collected during the run."""

    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)  # (kind, class) -> count
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    ttft: list[float] = field(default_factory=list)
    ttft_by_phase: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # outside bursts
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, bytes)
    heap_free: list[tuple[float, int]] = field(default_factory=list)  # the engine allocator's kept free bytes
    bursts: list[tuple[float, float]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


class Traffic:
    """Random requests of every kind, and the judgement of their answers."""

    def __init__(self, client: httpx.AsyncClient, cfg: SoakConfig, stats: SoakStats, start: float) -> None:
        self.client, self.cfg, self.stats, self.start = client, cfg, stats, start
        rng = random.Random(cfg.seed)
        self.prefixes = [self._ids(rng, cfg.shared_prefix_tokens) for _ in range(cfg.shared_prefixes)]

    @staticmethod
    def _ids(rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(FIRST_PLAIN_ID, FIRST_PLAIN_ID + PLAIN_ID_SPAN) for _ in range(n)]

    def _in_burst(self, at: float) -> bool:
        return any(start <= at <= end + 5.0 for start, end in self.stats.bursts)

    def adversary_on(self, at: float) -> bool:
        """Whether `at` (seconds since the start) falls in one of the adversary's phases."""
        return self.cfg.adversarial_share > 0 and int(at / self.cfg.adversary_phase_s) % 2 == 1

    def record(self, kind: str, status: int | None, sent: float, note: str = "") -> None:
        """Classify one answer; anything outside the pass criteria is kept as a failure."""
        now = time.monotonic()
        if status is None:
            outcome = "client_gone"
        elif status == 503:
            outcome = "503_overload" if self._in_burst(sent - self.start) or self._in_burst(now - self.start) \
                else "503_unexpected"
        elif status >= 500:
            outcome = "5xx"
        elif kind in REFUSED_KINDS:
            outcome = "4xx_expected" if 400 <= status < 500 else "bad_accepted"
        else:
            outcome = "ok" if status < 300 else "4xx_unexpected"
        self.stats.outcomes[(kind, outcome)] += 1
        if outcome in ("5xx", "503_unexpected", "4xx_unexpected", "bad_accepted"):
            self.stats.failures.append(f"{kind}: HTTP {status} {note[:300]}")
        if outcome == "ok":
            self.stats.latencies[kind].append(now - sent)

    def body(self, kind: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
        """Endpoint and JSON body of a valid request of `kind`."""
        cfg = self.cfg
        max_tokens = rng.randint(*cfg.max_tokens)
        if kind == "chat":
            words = ["cache", "state", "delta", "block", "prefix"]
            text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 40)))
            return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                                            "temperature": rng.choice([0.0, 0.7]), "stream": rng.random() < 0.5}
        if kind == "long":
            prompt = self._ids(rng, cfg.long_prompt_tokens)
        elif kind == "shared":
            prompt = rng.choice(self.prefixes) + self._ids(rng, rng.randint(1, 64))
        else:
            prompt = self._ids(rng, rng.randint(*cfg.short_prompt_tokens))
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": rng.choice([0.0, 1.0]),
                "stream": kind in ("stream", "abort") or (kind == "shared" and rng.random() < 0.5)}
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        return "/v1/completions", body

    @staticmethod
    def bad_request(rng: random.Random) -> tuple[str, bytes]:
        """A request the server must refuse with a 4xx."""
        choices = [
            ("/v1/completions", b"{not json"),
            ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": -3}).encode()),
            ("/v1/completions", json.dumps({"prompt": "", "max_tokens": 4}).encode()),
            ("/v1/completions", json.dumps({"prompt": [1, 2, 99999999], "max_tokens": 4}).encode()),
            ("/v1/completions", json.dumps({"model": "no-such-model", "prompt": "x"}).encode()),
            ("/v1/completions", json.dumps({"prompt": "x", "temperature": -1}).encode()),
            ("/v1/chat/completions", json.dumps({"messages": []}).encode()),
            ("/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode()),
            ("/v1/nowhere", b"{}"),
        ]
        return rng.choice(choices)

    def hostile_request(self, rng: random.Random) -> tuple[str, bytes]:
        """What an adversary sends: the bad requests, plus values past the server's limits, ids past
        int64, deep nesting, wrong types and schemas that do not compile."""
        return rng.choice(_HOSTILE + [self.bad_request(rng)])

    async def one(self, kind: str, rng: random.Random) -> None:
        """Send one request of `kind` and record its outcome."""
        sent = time.monotonic()
        try:
            if kind in REFUSED_KINDS:
                path, raw = self.bad_request(rng) if kind == "bad" else self.hostile_request(rng)
                response = await self.client.post(path, content=raw, headers={"Content-Type": "application/json"})
                self.record(kind, response.status_code, sent, response.text)
            elif kind == "disconnect":
                path, body = self.body("complete", rng)
                body["max_tokens"] = self.cfg.max_tokens[1]
                try:
                    response = await asyncio.wait_for(self.client.post(path, json=body), timeout=rng.uniform(0.01, 0.3))
                    self.record(kind, response.status_code, sent, response.text)
                except TimeoutError:
                    self.record(kind, None, sent)
            else:
                path, body = self.body(kind, rng)
                if body.get("stream"):
                    abandon_after = rng.randint(1, 3) if kind == "abort" else None
                    await self._stream(kind, path, body, sent, abandon_after=abandon_after)
                else:
                    response = await self.client.post(path, json=body)
                    self.record(kind, response.status_code, sent, response.text)
        except httpx.HTTPError as exc:
            self.stats.outcomes[(kind, "transport_error")] += 1
            self.stats.failures.append(f"{kind}: transport error {exc!r}")

    async def _stream(self, kind: str, path: str, body: dict[str, Any], sent: float, abandon_after: int | None) -> None:
        async with self.client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                self.record(kind, response.status_code, sent, (await response.aread()).decode(errors="replace"))
                return
            events = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events += 1
                if events == 1:
                    self.stats.ttft.append(time.monotonic() - sent)
                    at = sent - self.start
                    if not self._in_burst(at):
                        phase = "adversary" if self.adversary_on(at) else "quiet"
                        self.stats.ttft_by_phase[phase].append(time.monotonic() - sent)
                payload = line[len("data: "):]
                if payload != "[DONE]" and "error" in json.loads(payload):
                    self.stats.outcomes[(kind, "stream_error_event")] += 1
                    self.stats.failures.append(f"{kind}: error event {payload[:300]}")
                    return
                if abandon_after is not None and events >= abandon_after:
                    self.record(kind, None, sent)  # the client leaves mid-stream
                    return
            self.record(kind, 200, sent)


_HOSTILE: list[tuple[str, bytes]] = [
    ("/v1/completions", json.dumps({"prompt": [2 ** 64], "max_tokens": 4}).encode()),
    ("/v1/completions", json.dumps({"prompt": "x" * (5 << 20), "max_tokens": 4}).encode()),
    ("/v1/completions", b'{"prompt": "x", "stop": ' + b"[" * 5000 + b'"x"' + b"]" * 5000 + b"}"),
    ("/v1/completions", json.dumps({"prompt": "x", "stop": ["s"] * 1000}).encode()),
    ("/v1/completions", json.dumps({"prompt": {"a": 1}, "max_tokens": "many"}).encode()),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 10 ** 9}).encode()),
    ("/v1/completions", json.dumps({"prompt": ["x"] * 10_000, "max_tokens": 1}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}).encode()),
]


async def _client_loop(traffic: Traffic, seed: int, deadline: float) -> None:
    rng = random.Random(seed)
    share = traffic.cfg.adversarial_share
    kinds, weights = (KINDS, WEIGHTS) if share == 0 else zip(*[(k, w) for k, w in zip(KINDS, WEIGHTS) if k != "bad"])
    while time.monotonic() < deadline:
        hostile = traffic.adversary_on(time.monotonic() - traffic.start) and rng.random() < share
        await traffic.one("hostile" if hostile else rng.choices(list(kinds), list(weights))[0], rng)


async def _overload_loop(traffic: Traffic, cfg: SoakConfig, deadline: float) -> None:
    rng = random.Random(cfg.seed + 1000)
    while time.monotonic() + cfg.overload_every_s < deadline:
        await asyncio.sleep(cfg.overload_every_s)
        begin = time.monotonic() - traffic.start
        traffic.stats.bursts.append((begin, begin + 3600.0))
        await asyncio.gather(*(traffic.one("complete", random.Random(rng.random())) for _ in range(cfg.overload_burst)))
        traffic.stats.bursts[-1] = (begin, time.monotonic() - traffic.start)


async def _rss_loop(pid: int | None, client: httpx.AsyncClient, stats: SoakStats, start: float, interval: float,
                    deadline: float) -> None:
    while pid is not None and time.monotonic() < deadline:
        await _sample_memory(pid, client, stats, start)
        await asyncio.sleep(interval)


async def _sample_memory(pid: int, client: httpx.AsyncClient, stats: SoakStats, start: float) -> None:
    """One sample of the server's resident bytes and of the free bytes its engine's allocator keeps."""
    try:
        heap_free = int((await _engine_stats(client)).get("heap_free_bytes", 0))
    except (httpx.HTTPError, ValueError):
        heap_free = 0
    now = time.monotonic() - start
    stats.rss.append((now, _rss_bytes(pid)))
    stats.heap_free.append((now, heap_free))


def _rss_bytes(pid: int) -> int:
    """Resident bytes of `pid` and every process below it: the API process, its engine core and
    any tensor-parallel workers (the core's pools and the model live in the core process)."""
    return sum(_own_rss_bytes(p) for p in _process_tree(pid))


def _own_rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        return 0  # the process ended between the scan and the read
    return 0  # a zombie has no VmRSS


def _process_tree(pid: int) -> list[int]:
    """`pid` and its descendants, from the parent ids in /proc/*/stat."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children[parent].append(int(entry))
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in children.get(parent, ())]
        tree += frontier
    if not os.path.exists(f"/proc/{pid}/status"):
        raise OSError(f"no process {pid}")
    return tree


async def _engine_stats(client: httpx.AsyncClient) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = (await client.get("/metrics")).text
    return {sample.name.removeprefix("hybridserve_"): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


async def _wait_idle(client: httpx.AsyncClient, timeout: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        stats = await _engine_stats(client)
        if (stats.get("num_requests_running", 1) == 0 and stats.get("num_requests_waiting", 1) == 0
                and stats.get("kv_blocks_used", 1) == 0) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.5)


async def _warm_up(traffic: Traffic, cfg: SoakConfig) -> None:
    """Before the clock starts: one request of every kind, then twice `warmup_long_prompts` long
    prompts at once (the largest steps the traffic can form) and one overload burst. Outcomes are
    not counted."""
    rng = random.Random(cfg.seed - 1)
    for kind in KINDS:
        await traffic.one(kind, rng)
    for _ in range(2):
        await asyncio.gather(*(traffic.one("long", rng) for _ in range(cfg.warmup_long_prompts)))
    await asyncio.gather(*(traffic.one("complete", rng) for _ in range(cfg.overload_burst)))


async def run_soak_against(url: str, cfg: SoakConfig, server_pid: int | None) -> dict[str, Any]:
    """Drive the soak against `url`; `server_pid` (when local) is sampled for RSS."""
    limits = httpx.Limits(max_connections=cfg.clients + cfg.overload_burst + 8, keepalive_expiry=KEEPALIVE_EXPIRY_S)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=cfg.request_timeout_s) as client:
        stats = SoakStats()
        await _warm_up(Traffic(client, cfg, SoakStats(), time.monotonic()), cfg)
        initial = await _wait_idle(client, cfg.idle_timeout_s)
        start = time.monotonic()
        deadline = start + cfg.duration_s
        traffic = Traffic(client, cfg, stats, start)
        await asyncio.gather(_rss_loop(server_pid, client, stats, start, cfg.rss_interval_s, deadline),
                             _overload_loop(traffic, cfg, deadline),
                             *(_client_loop(traffic, cfg.seed + i, deadline) for i in range(cfg.clients)))
        elapsed = time.monotonic() - start
        final = await _wait_idle(client, cfg.idle_timeout_s)
        if server_pid is not None:
            await _sample_memory(server_pid, client, stats, start)
    return summarize(cfg, stats, initial, final, elapsed)


def _leaks(initial: dict[str, float], final: dict[str, float]) -> dict[str, float]:
    """Pool counters that differ from their idle values after the run."""
    leaks = {}
    for name in ("kv_blocks_used", "num_requests_running", "num_requests_waiting", "snapshots_reserved",
                 "snapshots_pinned"):
        if final.get(name, 0) != 0:
            leaks[name] = final[name]
    for free, total in (("kv_blocks_free", "kv_blocks_total"), ("state_slots_free", "state_slots_total")):
        if final.get(free) != initial.get(free) or final.get(free) != final.get(total):
            leaks[free] = final.get(free, float("nan"))
    return leaks


def net_rss(stats: SoakStats) -> list[tuple[float, int]]:
    """Resident bytes net of the free memory the engine's allocator keeps (a diagnostic: growth here
    is live memory, growth only in the gross figure is heap the allocator keeps)."""
    return [(t, rss - free) for (t, rss), (_, free) in zip(stats.rss, stats.heap_free)]


def rss_growth(rss: list[tuple[float, int]], window_s: float) -> float:
    """Relative growth of the mean RSS of the last window over the second window."""
    if not rss:
        return float("nan")
    end = rss[-1][0]
    second = [b for t, b in rss if window_s <= t < 2 * window_s]
    last = [b for t, b in rss if t >= end - window_s]
    if not second or not last:
        return float("nan")
    return (sum(last) / len(last)) / (sum(second) / len(second)) - 1.0


def summarize(cfg: SoakConfig, stats: SoakStats, initial: dict[str, float], final: dict[str, float],
              elapsed: float) -> dict[str, Any]:
    """The figures of a soak run and its verdict."""
    by_class: Counter[str] = Counter()
    for (_, outcome), count in stats.outcomes.items():
        by_class[outcome] += count
    leaks = _leaks(initial, final)
    growth = rss_growth(stats.rss, cfg.rss_window_s)
    all_latencies = [v for values in stats.latencies.values() for v in values]
    latency = {kind: {"n": len(v), "p50": percentile(v, 50), "p90": percentile(v, 90), "p99": percentile(v, 99)}
               for kind, v in sorted(stats.latencies.items())}
    latency["all"] = {"n": len(all_latencies), "p50": percentile(all_latencies, 50),
                      "p90": percentile(all_latencies, 90), "p99": percentile(all_latencies, 99)}
    rss_ok = growth != growth or growth < 0.05  # NaN (run shorter than two windows) is not judged
    phases = {phase: {"n": len(v), "p50": percentile(v, 50), "p99": percentile(v, 99)}
              for phase, v in sorted(stats.ttft_by_phase.items())}
    ratio = (phases["adversary"]["p99"] / phases["quiet"]["p99"]
             if {"adversary", "quiet"} <= phases.keys() and phases["quiet"]["p99"] > 0 else None)
    passed = not stats.failures and not leaks and rss_ok and by_class["503_overload"] > 0
    return {
        "config": asdict(cfg), "elapsed_s": elapsed, "requests": sum(stats.outcomes.values()),
        "by_class": dict(by_class), "by_kind": {f"{k}/{o}": c for (k, o), c in sorted(stats.outcomes.items())},
        "latency_s": latency, "ttft_s": {"p50": percentile(stats.ttft, 50), "p99": percentile(stats.ttft, 99)},
        "ttft_by_phase_s": phases, "adversary_ttft_p99_ratio": ratio,
        "leaks": leaks, "rss_growth": growth, "rss_growth_net": rss_growth(net_rss(stats), cfg.rss_window_s),
        "rss": stats.rss, "heap_free": stats.heap_free, "net_rss": net_rss(stats), "bursts": stats.bursts,
        "failures": stats.failures[:50], "initial": initial, "final": final, "passed": passed,
    }


def run_soak(cfg: SoakConfig, *, url: str | None = None, serve_args: Sequence[str] = ()) -> dict[str, Any]:
    """Run against `url`, or against a `hybridserve serve` subprocess started with `serve_args`."""
    if url is not None:
        return asyncio.run(run_soak_against(url.rstrip("/"), cfg, None))
    with ServerProcess(serve_args) as server:
        assert server.proc is not None
        result = asyncio.run(run_soak_against(server.url, cfg, server.proc.pid))
        result["server_argv"] = server.argv[2:]
        result["server_log_tail"] = server.log_tail(4000)
        return result


def format_soak_report(result: dict[str, Any]) -> str:
    """A plain-text report."""
    mib = 1 << 20
    lines = [f"soak: {result['elapsed_s']:.0f} s, {result['requests']} requests, "
             f"{'PASSED' if result['passed'] else 'FAILED'}",
             "outcomes: " + ", ".join(f"{k}={v}" for k, v in sorted(result["by_class"].items())),
             "latency (s, successful requests): " + "; ".join(
                 f"{kind} n={v['n']} p50={v['p50']:.2f} p90={v['p90']:.2f} p99={v['p99']:.2f}"
                 for kind, v in result["latency_s"].items()),
             f"stream TTFT p50={result['ttft_s']['p50']:.3f} s p99={result['ttft_s']['p99']:.3f} s",
             *(f"stream TTFT outside bursts, {phase} phases: n={v['n']} p50={v['p50']:.3f} s p99={v['p99']:.3f} s"
               for phase, v in result["ttft_by_phase_s"].items()),
             *([f"well-behaved stream TTFT p99, adversary phases / quiet phases: "
                f"{result['adversary_ttft_p99_ratio']:.2f} (goal <= 2)"] if result["adversary_ttft_p99_ratio"] else []),
             f"leaks after idle: {result['leaks'] or 'none'}"]
    if result["rss"]:
        rss, net = [b for _, b in result["rss"]], [b for _, b in result["net_rss"]]
        lines.append(f"server RSS (API and engine processes): start {rss[0] / mib:.0f} MiB, max {max(rss) / mib:.0f} "
                     f"MiB, end {rss[-1] / mib:.0f} MiB; net of the engine allocator's kept free memory: start "
                     f"{net[0] / mib:.0f} MiB, end {net[-1] / mib:.0f} MiB; growth last window vs second window "
                     f"{100 * result['rss_growth']:+.2f}% (goal < 5%; net {100 * result['rss_growth_net']:+.2f}%)")
    lines += [f"failure: {f}" for f in result["failures"][:10]]
    return "\n".join(lines)


def plot_rss(result: dict[str, Any], path: str | Path) -> None:
    """Server RSS over time, overload bursts shaded (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    times = [t for t, _ in result["rss"]]
    ax.plot(times, [b / (1 << 20) for _, b in result["rss"]], label="server RSS")
    ax.plot([t for t, _ in result["net_rss"]], [b / (1 << 20) for _, b in result["net_rss"]],
            label="net of the allocator's kept free memory")
    for index, (start, end) in enumerate(result["bursts"]):
        ax.axvspan(start, end, color="tab:red", alpha=0.15, label="overload burst" if index == 0 else None)
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    ax.set_title(f"hybridserve soak: {result['requests']} requests in {result['elapsed_s']:.0f} s, "
                 f"RSS growth {100 * result['rss_growth']:+.1f}%")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)



def build_parser() -> argparse.ArgumentParser:
    """The soak's flags: the engine's (for the server it starts), the `SoakConfig` fields, --url/--plot/--json."""
    from hybridserve.engine_args import add_engine_arguments

    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_arguments(parser)
    add_config_arguments(parser, SoakConfig)
    parser.add_argument("--url", default=None, help="soak a running server instead of starting one")
    parser.add_argument("--plot", metavar="PATH", default=None, help="save the RSS curve (matplotlib)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the figures as JSON here")
    # A small queue, so the overload bursts do overflow it.
    parser.set_defaults(max_num_seqs=4, max_waiting_requests=8, max_model_len=4096, kv_cache_mib=64.0,
                        prefix_cache_mib=64.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the soak, print the report; exit status 1 when its pass criteria fail."""
    from hybridserve.bench.cli import serve_args_from

    args = build_parser().parse_args(argv)
    result = run_soak(config_from_args(SoakConfig, args), url=args.url, serve_args=serve_args_from(args))
    print(format_soak_report(result), flush=True)
    if args.json:
        write_json(args.json, result)
    if args.plot and result["rss"]:
        plot_rss(result, args.plot)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

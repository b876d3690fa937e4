"""Smoke test of `hybridserve bench serve`: tiny sizes against a real `hybridserve serve` subprocess
that the benchmark starts and stops itself (no timing assertions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridserve.bench.configs import HTTP_CLIENTS, CompareConfig, config_from_args
from hybridserve.bench.serve_bench import RequestRecord, percentile, summarize
from hybridserve.bench.serve_client import ServerBackend
from hybridserve.cli import build_parser, main
from hybridserve.engine.async_engine import AsyncLLMEngine
from hybridserve.engine.engine import LLMEngine
from hybridserve.server.app import build_app
from tests.helpers.live_server import ServerThread, tiny_config
from tests.helpers.targets import CPU

pytestmark = pytest.mark.timeout(120)

TINY = ["--concurrency", "2", "--num-requests", "2", "--prefix-tokens", "32", "--suffix-tokens", "8",
        "--max-tokens", "3", "--mixed-background", "2", "--mixed-background-prompt-tokens", "8",
        "--mixed-background-max-tokens", "400", "--mixed-baseline-chunks", "2", "--mixed-prefix-tokens", "64",
        "--mixed-suffix-tokens", "8", "--mixed-max-tokens", "2", "--request-timeout", "60", "--level-timeout", "60"]
SMALL_ENGINE = [*CPU.cli_args(), "--kv-cache-mib", "16", "--prefix-cache-mib", "64", "--snapshot-interval", "32",
                "--max-model-len", "1024"]


def test_percentile_and_summary() -> None:
    assert percentile([], 50) != percentile([], 50)  # NaN
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0 and percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    record = RequestRecord(start=0.0, chunk_times=[0.5, 0.6, 0.8], prompt_tokens=10, completion_tokens=3,
                           cached_tokens=5)
    row = summarize([record, RequestRecord(error="boom")], wall_s=2.0)
    assert row["errors"] == 1 and row["ttft_p50_ms"] == 500.0 and row["cached_share"] == 0.5
    assert row["itl_p50_ms"] == pytest.approx(150.0) and row["output_tokens_per_s"] == 1.5


def test_bench_serve_parses() -> None:
    args = build_parser().parse_args(["bench", "serve", "--kv-cache-mib", "16"])
    assert callable(args.handler) and args.concurrency == [1, 4, 8, 16] and args.url is None
    compare = build_parser().parse_args(["bench", "serve", "--compare-offline", "--compare-modes", "on"])
    assert compare.compare_offline and compare.compare_modes == ["on"] and not args.compare_offline


def test_bench_serve_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", *TINY, *SMALL_ENGINE, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {row["workload"]: row for row in result["rows"]}
    assert set(rows) == {"shared-prefix", "no-reuse"} and result["server"]["started"]
    for row in rows.values():
        assert row["requests"] == 2 and row["errors"] == 0 and row["output_tokens"] == 6
        assert row["prompt_tokens"] == 2 * 40
    assert rows["shared-prefix"]["cached_tokens"] > 0 and rows["no-reuse"]["cached_tokens"] == 0
    mixed = result["mixed"]
    assert mixed["injected_error"] is None and mixed["injected_prompt_tokens"] == 72
    assert mixed["injected_cached_tokens"] >= 32 and mixed["baseline_gaps"] > 0
    assert "shared-prefix" in capsys.readouterr().out


@pytest.mark.parametrize("http_client", HTTP_CLIENTS)
def test_compare_backend_streams_over_each_http_client(http_client: str) -> None:
    """The server backend of `--compare-offline`, over aiohttp and httpx: one timed request, a
    concurrent batch, and a refused request recorded as an error."""
    engine = AsyncLLMEngine(LLMEngine(tiny_config()), max_waiting_requests=16)
    try:
        with ServerThread(build_app(engine, model_name="tiny")) as server:
            backend = ServerBackend(server.url, clients=2, http_client=http_client)
            try:
                ttft, wall = backend.one([300, 301, 302, 303], 4)
                assert 0 < ttft <= wall
                assert backend.batch([[310, 311], [320, 321, 322]], 3)[0] == 6
                refused = backend.loop.run_until_complete(backend.api.stream([10**9], 2))
                assert refused.error is not None and refused.error.startswith("HTTP 400")
                assert refused.completion_tokens == 0 and not refused.chunk_times
            finally:
                backend.close()
    finally:
        engine.shutdown()


def test_compare_http_clients_flag() -> None:
    args = build_parser().parse_args(["bench", "serve", "--compare-offline", "--compare-http-clients", "httpx"])
    assert config_from_args(CompareConfig, args).http_clients == ("httpx",)
    with pytest.raises(ValueError, match="unknown HTTP client"):
        ServerBackend("http://127.0.0.1:1", clients=1, http_client="curl")

"""Issue 35's restart acceptance, as a user runs it: `hybridserve serve --disk-cache-dir DIR`, a
4,000-token prompt, SIGTERM, the same flags again: the same prompt reports at least 3,900 cached
tokens, restored from the disk; started with another dtype on that directory, it reports none."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from hybridserve.bench.serve_client import ServerProcess

pytestmark = pytest.mark.timeout(300)
PROMPT_TOKENS = 4000


def _serve(directory: Path, dtype: str) -> ServerProcess:
    """`serve` on the built-in model with a disk tier in `directory` (stopped with SIGTERM on exit)."""
    return ServerProcess(["--device", "cpu", "--dtype", dtype, "--engine-process", "off", "--kv-cache-memory",
                          "256MiB", "--disk-cache-dir", str(directory), "--disk-cache-size", "1GiB"], threads=1)


def _cached_tokens(server: ServerProcess, prompt: list[int]) -> int:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] == PROMPT_TOKENS
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def _stopped_cleanly(server: ServerProcess) -> bool:
    server.stop()
    return server.proc is not None and server.proc.returncode == 0


def test_a_served_prompt_is_restored_from_disk_after_a_restart_but_not_by_another_dtype(tmp_path: Path) -> None:
    directory = tmp_path / "tiers"
    directory.mkdir(mode=0o700)
    prompt = [(7919 * i) % 3000 + 100 for i in range(PROMPT_TOKENS)]
    with _serve(directory, "float32") as server:
        assert _cached_tokens(server, prompt) == 0
        assert _stopped_cleanly(server), server.log_tail()  # SIGTERM drains the writes to the disk
    with _serve(directory, "float32") as server:
        assert _cached_tokens(server, prompt) >= 3900
    with _serve(directory, "bfloat16") as server:
        assert _cached_tokens(server, prompt) == 0

"""Issue 35's restart acceptance, as a user runs it: `hybridserve serve --disk-cache-dir DIR`, a
4,000-token prompt, SIGTERM, the same flags again: the same prompt reports at least 3,900 cached
tokens, restored from the disk; started with another dtype on that directory, it reports none."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)
PROMPT_TOKENS = 4000
START_TIMEOUT_S = 120.0  # a safety net: the loop returns as soon as /health answers


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def _serve(directory: Path, dtype: str) -> Iterator[str]:
    """A `serve` process on the built-in model with a disk tier in `directory`; its URL. Stopped
    with SIGTERM on exit (it must exit 0)."""
    port = _free_port()
    command = [sys.executable, "-m", "hybridserve.cli", "serve", "--device", "cpu", "--dtype", dtype,
               "--engine-process", "off", "--threads", "1", "--kv-cache-memory", "256MiB",
               "--disk-cache-dir", str(directory), "--disk-cache-size", "1GiB", "--port", str(port),
               "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert process.poll() is None, process.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "serve did not start"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield url
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def _cached_tokens(url: str, prompt: list[int]) -> int:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] == PROMPT_TOKENS
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def test_a_served_prompt_is_restored_from_disk_after_a_restart_but_not_by_another_dtype(tmp_path: Path) -> None:
    directory = tmp_path / "tiers"
    directory.mkdir(mode=0o700)
    prompt = [(7919 * i) % 3000 + 100 for i in range(PROMPT_TOKENS)]
    with _serve(directory, "float32") as url:
        assert _cached_tokens(url, prompt) == 0
    with _serve(directory, "float32") as url:
        assert _cached_tokens(url, prompt) >= 3900
    with _serve(directory, "bfloat16") as url:
        assert _cached_tokens(url, prompt) == 0

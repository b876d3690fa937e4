"""`hybridserve serve --replicas 2` as a user runs it: serves the API, stops cleanly on SIGTERM; a
replica that cannot start (flags its engine refuses) is one error line naming the engine's reason.
Slow: each run starts its own local Ray instance."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("ray.serve", reason="the replica tests need `pip install hybridserve[ray]`")

from tests.replicas.cluster import free_port  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SERVE = [sys.executable, "-m", "hybridserve.cli", "serve", "--replicas", "2", "--device", "cpu", "--dtype",
         "float32", "--engine-process", "off", "--threads", "1"]


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("ERROR hybridserve")]


def test_serve_replicas_answers_and_stops_on_sigterm() -> None:
    port = free_port()
    process = subprocess.Popen([*SERVE, "--kv-cache-memory", "160MiB", "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, process.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the replicas did not start"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        body = {"prompt": "Hello hybrid world", "max_tokens": 5, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr[-2000:]
    assert "replicas stopped" in stderr and not _errors(stderr)


def test_a_replica_that_cannot_start_is_one_error_line() -> None:
    result = subprocess.run([*SERVE, "--kv-cache-memory", "32MiB", "--port", str(free_port())],
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = _errors(result.stderr)
    assert len(errors) == 1 and "cannot start the replicas: ValueError: the KV pool" in errors[0], errors

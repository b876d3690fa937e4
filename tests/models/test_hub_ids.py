"""Hub ids (`org/name`) resolve through huggingface_hub: from its local cache when offline, and
with a one-line error naming the local-directory alternative when the model cannot be found.

huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when it is imported, so each case runs in a fresh
interpreter with its own environment."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybridserve.models.loader import is_hub_id, resolve_model

REPO = Path(__file__).resolve().parents[2]
REVISION = "0123456789abcdef0123456789abcdef01234567"


def _run(code: str, hf_home: Path, *, offline: bool) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HOME": str(hf_home), "PYTHONPATH": str(REPO), "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "5"}
    env.pop("HF_HUB_CACHE", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    else:
        env.pop("HF_HUB_OFFLINE", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)


def _cached_snapshot(hf_home: Path, repo_id: str, checkpoint: Path) -> Path:
    """Lay `checkpoint` out as huggingface_hub's cache holds a downloaded snapshot of `repo_id`."""
    repo_dir = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / REVISION
    shutil.copytree(checkpoint, snapshot)
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.mark.parametrize(("name", "hub"), [("Qwen/Qwen3.5-0.8B", True), ("tiny", True), ("/abs/dir", False),
                                           ("./rel", False), ("a/b/c", False), ("~/model", False), ("../x", False)])
def test_hub_id_spelling(name: str, hub: bool) -> None:
    assert is_hub_id(name) is hub


def test_local_directory_wins_and_missing_path_says_so(tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "absent"))


def test_offline_uncached_hub_id_names_the_local_directory_alternative(tmp_path: Path) -> None:
    code = ("from hybridserve.models.loader import resolve_model\n"
            "try:\n    resolve_model('acme/absent-model')\n"
            "except ValueError as e:\n    print('ERROR', e)\n")
    run = _run(code, tmp_path / "hf", offline=True)
    assert run.returncode == 0, run.stderr[-3000:]
    message = run.stdout.strip()
    assert message.startswith("ERROR") and len(message.splitlines()) == 1
    assert "acme/absent-model" in message and "HF_HUB_OFFLINE" in message and "--model DIR" in message


def test_unreachable_hub_gives_the_same_one_line_error(tmp_path: Path) -> None:
    code = ("from hybridserve.models.loader import resolve_model\n"
            "try:\n    resolve_model('acme/absent-model')\n"
            "except ValueError as e:\n    print('ERROR', e)\n")
    run = _run(code, tmp_path / "hf", offline=False)
    assert run.returncode == 0, run.stderr[-3000:]
    message = run.stdout.strip()
    assert message.startswith("ERROR") and len(message.splitlines()) == 1 and "--model DIR" in message


def test_generate_runs_a_hub_id_from_the_offline_cache(tmp_path: Path, text_checkpoint: Path) -> None:
    hf_home = tmp_path / "hf"
    snapshot = _cached_snapshot(hf_home, "acme/tiny-qwen", text_checkpoint)
    code = ("from hybridserve.models.loader import resolve_model\n"
            "print('RESOLVED', resolve_model('acme/tiny-qwen'))\n"
            "import sys\nfrom hybridserve.cli import main\n"
            "sys.exit(main(['generate', '--model', 'acme/tiny-qwen', '--max-tokens', '3', '--ignore-eos',"
            " '--kv-cache-mib', '8', '--prefix-cache-mib', '4']))\n")
    run = _run(code, hf_home, offline=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"RESOLVED {snapshot}" in run.stdout

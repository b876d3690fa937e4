"""`hybridserve.envs` and the process settings: importing hybridserve changes nothing, an engine
start sets the same threads and oneDNN settings whichever of torch and hybridserve was imported
first, and spawned children get the OpenMP environment. Settings only; speed is measured by
`hybridserve bench import-order`."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridserve import envs
from hybridserve.engine import threads

PACKAGE = Path(__file__).resolve().parents[2] / "hybridserve"
REPO_ROOT = PACKAGE.parent

ENV_AFTER_IMPORT = """
import json, os, sys
{preload}
before = dict(os.environ)
{imports}
after = dict(os.environ)
changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
print(json.dumps({{"changed": changed, "torch_loaded": "torch" in sys.modules}}))
"""

SETTINGS_AFTER_ENGINE_START = """
import json, os, sys
{imports}
from hybridserve.config import CacheConfig, EngineConfig
from hybridserve.engine.engine import LLMEngine
openmp_before = {{name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}}
engine = LLMEngine(EngineConfig(model=sys.argv[1], device="cpu", dtype="float32",
                                cache=CacheConfig(kv_cache_mib=4, prefix_cache_mib=0)))
print(json.dumps({{
    "engine_threads": engine.num_threads,
    "torch_threads": torch.get_num_threads(),
    "cores": len(os.sched_getaffinity(0)),
    "onednn": {{name: os.environ.get(name) for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}},
    "openmp_unchanged": openmp_before == {{name: os.environ.get(name) for name in openmp_before}},
}}))
"""

ORDERS = {"torch first": "import torch\nimport hybridserve", "hybridserve first": "import hybridserve\nimport torch"}


def _clean_env() -> dict[str, str]:
    """This environment without the variables the engine would set (so a change is visible)."""
    drop = {*threads.OPENMP_ENVIRONMENT, *threads.ONEDNN_ENVIRONMENT}
    return {name: value for name, value in os.environ.items() if name not in drop}


def _run_json(code: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600,
                          env=_clean_env(), cwd=REPO_ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("preload, imports", [
    ("", "import hybridserve"),
    ("import torch", "import hybridserve"),
    ("", "import torch\nimport hybridserve"),
    # torch._dynamo (loaded by torch.nn.attention.bias) sets TORCHINDUCTOR_CACHE_DIR: torch's own, preloaded
    ("import torch._dynamo", "from hybridserve import LLM, envs\nimport hybridserve.engine.engine"),
])
def test_import_changes_no_environment_variable(preload: str, imports: str) -> None:
    result = _run_json(ENV_AFTER_IMPORT.format(preload=preload, imports=imports))
    assert result["changed"] == []


def test_import_hybridserve_does_not_load_torch() -> None:
    assert _run_json(ENV_AFTER_IMPORT.format(preload="", imports="import hybridserve"))["torch_loaded"] is False


def test_engine_start_settings_do_not_depend_on_import_order(text_checkpoint: Path) -> None:
    results = {order: _run_json(SETTINGS_AFTER_ENGINE_START.format(imports=imports), str(text_checkpoint))
               for order, imports in ORDERS.items()}
    first, second = results.values()
    assert first == second, results
    assert first["engine_threads"] == first["torch_threads"] == first["cores"]
    assert first["onednn"] == threads.ONEDNN_ENVIRONMENT
    assert first["openmp_unchanged"]  # a user's process keeps its own OpenMP environment


def test_apply_process_settings_keeps_explicit_values(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    before = torch.get_num_threads()
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    try:
        settings = threads.apply_process_settings(1, "cpu")
        assert settings.num_threads == 1 and torch.get_num_threads() == 1
        assert settings.onednn_environment == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "7",
                                               "LRU_CACHE_CAPACITY": threads.ONEDNN_CACHE_CAPACITY}
    finally:
        torch.set_num_threads(before)


def test_started_process_environment_respects_the_user(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*threads.OPENMP_ENVIRONMENT, *threads.ONEDNN_ENVIRONMENT):
        monkeypatch.delenv(name, raising=False)
    assert threads.started_process_environment() == {**threads.OPENMP_ENVIRONMENT, **threads.ONEDNN_ENVIRONMENT}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # an explicit policy keeps its own spin count
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "16")
    assert threads.started_process_environment() == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": threads.ONEDNN_CACHE_CAPACITY}


def _report_environment(queue: multiprocessing.Queue) -> None:
    queue.put({name: os.environ.get(name) for name in (*threads.OPENMP_ENVIRONMENT, *threads.ONEDNN_ENVIRONMENT)})


def test_spawned_child_gets_the_openmp_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch  # noqa: F401 - the parent has loaded torch (and OpenMP) already; the child has not

    for name in (*threads.OPENMP_ENVIRONMENT, *threads.ONEDNN_ENVIRONMENT):
        monkeypatch.delenv(name, raising=False)
    parent_before = dict(os.environ)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_report_environment, args=(queue,))
    with threads.child_process_environment() as added:
        process.start()
    try:
        child = queue.get(timeout=120)
    finally:
        process.join(timeout=60)
    assert dict(os.environ) == parent_before  # restored in the parent
    assert child == {**threads.OPENMP_ENVIRONMENT, **threads.ONEDNN_ENVIRONMENT} == added


def test_command_process_gets_the_openmp_environment_before_torch() -> None:
    code = ("import json, os, sys\nfrom hybridserve.cli import main\ntry:\n    main(['sim', '--help'])\n"
            "except SystemExit:\n    pass\n"
            "print(json.dumps({'env': {n: os.environ.get(n) for n in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')}, "
            "'torch_loaded': 'torch' in sys.modules}))")
    result = _run_json(code)
    assert result == {"env": threads.OPENMP_ENVIRONMENT, "torch_loaded": False}


@pytest.mark.parametrize("value, expected", [(None, True), ("", True), ("1", True), ("yes", True), ("0", False),
                                             (" OFF ", False), ("false", False), ("No", False)])
def test_flags_are_read_when_called(monkeypatch: pytest.MonkeyPatch, value: str | None, expected: bool) -> None:
    for variable in envs.ENVIRONMENT_VARIABLES:
        if variable.type != "bool":
            continue
        if value is None:
            monkeypatch.delenv(variable.name, raising=False)
        else:
            monkeypatch.setenv(variable.name, value)
        unset = value is None or not value.strip()
        assert envs.read_flag(variable) is (variable.default == "1" if unset else expected)
    assert (envs.native_kernels(), envs.amx(), envs.one_call_step(), envs.huge_pages(),
            envs.shm_allreduce()) == (expected,) * 5
    assert envs.server_dev_mode() is (expected and value not in (None, ""))  # the one switch off by default


def test_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(envs.API_KEY.name, raising=False)
    assert envs.api_key() is None
    monkeypatch.setenv(envs.API_KEY.name, "")
    assert envs.api_key() is None
    monkeypatch.setenv(envs.API_KEY.name, "secret")
    assert envs.api_key() == "secret"


def test_accessor_type_is_checked() -> None:
    with pytest.raises(TypeError):
        envs.read_flag(envs.API_KEY)
    with pytest.raises(TypeError):
        envs.read_str(envs.AMX)


def test_every_variable_the_package_names_is_declared() -> None:
    declared = {variable.name for variable in envs.ENVIRONMENT_VARIABLES}
    named = {match for path in PACKAGE.rglob("*.py")
             for match in re.findall(r"\bHYBRIDSERVE_[A-Z0-9_]+\b", path.read_text(encoding="utf-8"))}
    assert named <= declared, f"not declared in hybridserve/envs.py: {sorted(named - declared)}"
    assert len(declared) == len(envs.ENVIRONMENT_VARIABLES)
    assert all(variable.meaning and variable.type in ("bool", "str") for variable in envs.ENVIRONMENT_VARIABLES)


def test_only_envs_reads_hybridserve_variables() -> None:
    """Outside envs.py (and engine/threads.py, which sets OpenMP's and oneDNN's), the package reads the
    environment only by literal names, none of them ours."""
    read = re.compile(r"os\.(?:environ\.get|getenv)\(\s*([^,)]+)|os\.environ\[\s*([^\]]+)\]")
    exempt = {PACKAGE / "envs.py", PACKAGE / "engine" / "threads.py"}
    offenders = []
    for path in sorted(set(PACKAGE.rglob("*.py")) - exempt):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in read.finditer(line):
                key = (match.group(1) or match.group(2)).strip()
                if not re.fullmatch(r"[\"'][A-Z0-9_]+[\"']", key) or "HYBRIDSERVE_" in key:
                    offenders.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert offenders == []

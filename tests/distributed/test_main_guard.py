"""Tensor parallelism from a script without an `if __name__ == "__main__":` guard: the rank
processes are spawned without importing the caller's script again, so it just works."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """\
import sys
print("TOP LEVEL RAN", flush=True)  # once: the ranks must not run the script again
from hybridserve import LLM, SamplingParams
llm = LLM(tensor_parallel_size=2, kv_cache_mib=16, prefix_cache_mib=8)
out = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
print("TOKENS", len(out[0].outputs[0].token_ids), flush=True)
"""


@pytest.mark.slow
def test_tensor_parallel_in_a_script_without_a_main_guard(tmp_path: Path) -> None:
    script = tmp_path / "no_guard.py"
    script.write_text(SCRIPT)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.count("TOP LEVEL RAN") == 1
    assert "TOKENS 4" in run.stdout


def test_main_module_is_restored_after_start() -> None:
    from hybridserve.distributed.executor import main_module_not_reimported

    main = sys.modules["__main__"]
    before = (main.__dict__.get("__file__"), main.__dict__.get("__spec__"))
    with main_module_not_reimported():
        assert getattr(main, "__spec__", None) is None and not hasattr(main, "__file__")
    assert (main.__dict__.get("__file__"), main.__dict__.get("__spec__")) == before

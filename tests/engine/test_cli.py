"""`hybridserve --help` and every subcommand's `--help` answer without importing torch (checked on
the modules loaded, not on the time taken)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

EVERY_COMMAND_HELP = """
import argparse, contextlib, io, json, sys
from hybridserve.cli import build_parser, main

def commands(parser, prefix):
    yield prefix
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, [*prefix, name])

checked, loaded_torch = [], []
for command in list(commands(build_parser(), [])):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            main([*command, "--help"])
        except SystemExit:
            pass
    assert "usage:" in out.getvalue(), command
    checked.append(" ".join(command))
    if "torch" in sys.modules and not loaded_torch:
        loaded_torch.append(" ".join(command))
print(json.dumps({"checked": checked, "first_to_load_torch": loaded_torch}))
"""


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                          check=False)


def test_top_level_help_imports_no_torch() -> None:
    done = _run(["-X", "importtime", "-m", "hybridserve.cli", "--help"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: hybridserve" in done.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert "hybridserve.engine_args" in imported  # the parser was built (the CLI itself runs as __main__)
    assert not [name for name in imported if name == "torch" or name.startswith("torch.")]


def test_every_subcommand_help_imports_no_torch() -> None:
    done = _run(["-c", EVERY_COMMAND_HELP])
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["first_to_load_torch"] == []
    checked = set(result["checked"])
    assert {"", "generate", "serve", "sim", "bench", "bench serve", "bench decode", "bench tp"} <= checked

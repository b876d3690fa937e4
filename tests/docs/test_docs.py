"""The docs stay true to the code: the generated configuration page matches the parsers, relative
links resolve, and the README keeps its Quick start and its size."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
# A markdown link's target, up to a '#' anchor: [text](target) or [text](target#anchor).
LINK = re.compile(r"\[[^\]]*\]\(([^)#\s]*)(?:#[^)\s]*)?\)")


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_doc", REPO_ROOT / "scripts" / "gen_config_doc.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_page_matches_the_parsers() -> None:
    generator = _generator()
    committed = generator.DOC_PATH.read_text()
    assert generator.render() == committed, (
        "docs/configuration.md differs from the command-line parsers: run "
        "`.venv/bin/python scripts/gen_config_doc.py` and commit the result")


def test_configuration_page_lists_every_command_and_variable() -> None:
    from hybridserve import envs

    text = (DOCS / "configuration.md").read_text()
    for command in ("generate", "serve", "sim", "bench ttft", "bench serve"):
        assert f"## `hybridserve {command}`" in text
    for variable in envs.ENVIRONMENT_VARIABLES:
        assert f"`{variable.name}`" in text


def _markdown_files() -> list[Path]:
    return [README, REPO_ROOT / "tests" / "README.md", *sorted(DOCS.glob("*.md"))]


def test_relative_links_resolve() -> None:
    broken = []
    for page in _markdown_files():
        for target in LINK.findall(page.read_text()):
            if not target or "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO_ROOT)} -> {target}")
    assert not broken, "links to missing files: " + ", ".join(broken)


def test_readme_quick_start_and_size() -> None:
    text = README.read_text()
    assert "make run    # set up a venv and serve the built-in model on http://127.0.0.1:8000 (OpenAI API)" in text
    assert "make test   # set up a venv and run the test suite" in text
    assert ".venv/bin/python -m pytest -q" in text
    assert len(text.splitlines()) <= 220, "README.md should stay near 200 lines; move detail to docs/"


def test_benchmarks_page_size() -> None:
    assert len((DOCS / "benchmarks.md").read_text().splitlines()) <= 420


def test_module_map_names_every_module_and_no_missing_one() -> None:
    package = REPO_ROOT / "hybridserve"
    text = (DOCS / "architecture.md").read_text()
    modules = {path.relative_to(package).as_posix() for path in package.rglob("*.py")
               if path.name != "__init__.py" or path.parent == package}
    unmapped = sorted(module for module in modules if f"`{module}`" not in text)
    assert not unmapped, "docs/architecture.md's module map lacks: " + ", ".join(unmapped)
    table = "\n".join(line for line in text.splitlines() if line.startswith("| `"))
    mapped = set(re.findall(r"`([a-z_]+(?:/[a-z_0-9]+)*\.py)`", table))
    stale = sorted(module for module in mapped if not (package / module).exists())
    assert not stale, "docs/architecture.md's module map names modules that do not exist: " + ", ".join(stale)

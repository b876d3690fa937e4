"""The C kernels are loaded only from a cache directory that nobody else can write to."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from hybridserve.layers import native


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private XDG cache home the kernels directory is resolved under."""
    home = tmp_path / "cache-home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_fresh_cache_dir_is_created_private(cache_home: Path) -> None:
    directory = native._private_kernel_dir()
    assert directory == cache_home / "hybridserve" / "kernels"
    assert _mode(directory) & 0o077 == 0
    assert _mode(directory.parent) & 0o022 == 0


@pytest.mark.parametrize("which", ["kernels", "hybridserve"])
def test_group_writable_cache_dir_is_not_used(cache_home: Path, which: str,
                                              caplog: pytest.LogCaptureFixture) -> None:
    kernels = cache_home / "hybridserve" / "kernels"
    kernels.mkdir(parents=True, mode=0o700)
    loose = kernels if which == "kernels" else kernels.parent
    os.chmod(loose, 0o770)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        directory = native._private_kernel_dir()
    assert directory != kernels and not directory.is_relative_to(cache_home)
    assert _mode(directory) == 0o700 and directory.stat().st_uid == os.geteuid()
    warning = " ".join(record.getMessage() for record in caplog.records)
    assert str(loose) in warning and "chmod 700" in warning


def test_symlinked_cache_dir_is_not_used(cache_home: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (cache_home / "hybridserve").mkdir(mode=0o700)
    (cache_home / "hybridserve" / "kernels").symlink_to(elsewhere)
    assert native._private_kernel_dir() != cache_home / "hybridserve" / "kernels"


def test_untrusted_library_file_is_rebuilt(cache_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached library writable by others is replaced by a fresh build, never loaded as found."""
    builds: list[Path] = []

    def fake_build(compiler: str, target: Path) -> None:
        builds.append(target)
        target.write_bytes(b"rebuilt")
        os.chmod(target, 0o600)

    monkeypatch.setattr(native, "_compiler", lambda: "cc")
    monkeypatch.setattr(native, "_build", fake_build)
    first = native._compiled_library()
    assert first is not None and builds == [first]
    assert native._compiled_library() == first and len(builds) == 1  # a trusted cached build is reused
    os.chmod(first, 0o666)
    assert native._compiled_library() == first and len(builds) == 2
    assert first.read_bytes() == b"rebuilt"

"""Checks on the disk tier's directory (`--disk-cache-dir`), without torch, so the command-line
flags can be validated before anything heavy is imported.

The directory must belong to the user running the server and must not be writable by its group or
by others: cached objects become model state on a hit, so another user who could write there could
change what the model says. `check_disk_cache_dir` only inspects; `prepare_store_dir` creates the
per-fingerprint directory (0700) the disk store writes its objects into.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

PRIVATE_DIR_MODE = 0o700


class DiskCacheDirError(ValueError):
    """The disk cache directory cannot be used (one line that says why)."""


def _check_existing_dir(path: Path, label: str) -> None:
    info = path.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise DiskCacheDirError(f"{label} {str(path)!r} is not a directory")
    if info.st_uid != os.geteuid():
        raise DiskCacheDirError(f"{label} {str(path)!r} is owned by another user (uid {info.st_uid})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise DiskCacheDirError(f"{label} {str(path)!r} is writable by its group or others "
                                f"(mode {stat.S_IMODE(info.st_mode):o}); use chmod 700")
    if not os.access(path, os.W_OK | os.X_OK):
        raise DiskCacheDirError(f"{label} {str(path)!r} is not writable")


def check_disk_cache_dir(directory: str | os.PathLike[str]) -> Path:
    """The absolute path of `directory` after checking that the disk tier can use it: an existing
    directory must be ours, not group- or world-writable, and writable; a missing one must have a
    writable nearest existing parent (it is created 0700 when the store starts). Raises
    `DiskCacheDirError` (a `ValueError`) otherwise."""
    path = Path(directory).expanduser().absolute()
    if path.exists():
        _check_existing_dir(path, "--disk-cache-dir")
        return path
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise DiskCacheDirError(f"--disk-cache-dir {str(path)!r} does not exist and cannot be created "
                                f"({str(parent)!r} is not writable)")
    return path


def prepare_store_dir(directory: str | os.PathLike[str], fingerprint: str) -> Path:
    """Create (if needed) `directory` and `directory/<fingerprint>` with mode 0700 and return the
    latter; `DiskCacheDirError` when either fails the checks of `check_disk_cache_dir`."""
    if not fingerprint or not all(c.isalnum() or c in "-_" for c in fingerprint):
        raise DiskCacheDirError(f"invalid model fingerprint {fingerprint!r} (letters, digits, '-' and '_')")
    root = check_disk_cache_dir(directory)
    try:
        root.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        store_dir = root / fingerprint
        if not store_dir.exists():
            store_dir.mkdir(mode=PRIVATE_DIR_MODE)
            os.chmod(store_dir, PRIVATE_DIR_MODE)  # mkdir's mode is filtered by the umask
    except OSError as error:
        raise DiskCacheDirError(f"cannot create the disk cache directory under {str(root)!r}: "
                                f"{error.strerror or error}") from error
    _check_existing_dir(root, "--disk-cache-dir")
    _check_existing_dir(store_dir, "disk cache directory")
    if stat.S_IMODE(store_dir.stat().st_mode) != PRIVATE_DIR_MODE:
        os.chmod(store_dir, PRIVATE_DIR_MODE)
    return store_dir

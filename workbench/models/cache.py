"""Converted model folders in the user's cache, published whole or not at all.

A conversion takes tens of seconds and writes half a gigabyte. Killed halfway (Ctrl-C, a kernel
restart, a CI timeout) it must never leave a folder that a later call takes for the model and
loads with missing or truncated weights. So a folder is written under a hidden temporary name
beside its final one, its files are flushed to disk, its manifest is written last, and it is
renamed into place in one step: a folder at the final name is complete by construction, and
``ready`` also asks for its manifest. A temporary folder untouched for an hour is a dead
conversion; the next conversion removes it (a younger one may be another process's live one).

The cache root is the one the stdlib corpus uses (``kernels_runtime.user_cache``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kernels_runtime.user_cache import cache_root

MANIFEST = "manifest.json"
FORMAT = 1  # bumped when a conversion changes, so older folders are converted again
STALE_S = 3600.0


def model_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """``<cache>/models/<name>``: the cache is ``cache_dir``, else ``$WORKBENCH_CACHE_DIR``,
    else ``~/.cache/colossal-workbench``."""
    return cache_root(cache_dir) / "models" / name


def read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def ready(folder: Path) -> bool:
    """A published folder of this format (a bare or half folder has no manifest)."""
    manifest = read_manifest(folder)
    return manifest is not None and manifest.get("format") == FORMAT


def temp_prefix(folder: Path) -> str:
    return f".{folder.name}.tmp-"


@contextmanager
def staging_dir(folder: Path) -> Iterator[Path]:
    """A fresh temporary folder beside ``folder``, removed on the way out unless published."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    sweep(folder)
    staging = Path(tempfile.mkdtemp(prefix=temp_prefix(folder), dir=folder.parent))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already once renamed into place


def sweep(folder: Path, older_than_s: float = STALE_S) -> list[Path]:
    """Remove dead conversions' temporary folders beside ``folder``; the ones removed."""
    now, removed = time.time(), []
    for path in folder.parent.glob(temp_prefix(folder) + "*"):
        try:
            if path.is_dir() and now - path.stat().st_mtime > older_than_s:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        except OSError:  # another process's sweep got there first
            continue
    return removed


def publish(staging: Path, folder: Path, manifest: dict[str, Any]) -> Path:
    """Flush ``staging``, write its manifest, and rename it to ``folder``; ``folder``.

    A folder already at the name that is not ready (an older format, or one made by hand) is
    replaced; a ready one published meanwhile by another process wins, and ours is dropped."""
    for path in staging.rglob("*"):
        if path.is_file():
            _fsync(path)
    record = {"format": FORMAT, "name": folder.name, **manifest}
    (staging / MANIFEST).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    _fsync(staging / MANIFEST)
    staging.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from its other users
    if folder.exists() and not ready(folder):
        shutil.rmtree(folder)
    try:
        os.rename(staging, folder)
    except OSError:
        if ready(folder):
            return folder
        raise
    _fsync(folder.parent)
    return folder


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

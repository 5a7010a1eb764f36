"""The user's cache folder for what the workbench builds once and reuses (the stdlib corpus,
converted models): ``cache_dir`` if given, else ``$WORKBENCH_CACHE_DIR``, else
``~/.cache/colossal-workbench``. Torch-free, so the notebook side can name it too."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "WORKBENCH_CACHE_DIR"
DEFAULT_CACHE = Path("~/.cache/colossal-workbench")


def cache_root(cache_dir: str | Path | None = None) -> Path:
    return Path(cache_dir or os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()

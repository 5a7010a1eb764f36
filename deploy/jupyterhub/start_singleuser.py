"""Each user's server starts here: put the example notebooks in the home, then become
``jupyterhub-singleuser``.

Why it exists: the local spawner runs the server as the user, so the copy happens with the
user's own rights (the hub never writes into homes). Files the user already has are kept,
edits included; new notebooks of a newer workbench appear at the next start.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def copy_missing(src: Path, dst: Path) -> int:
    """Copy every file of ``src`` missing under ``dst``; the number copied."""
    copied = 0
    for path in sorted(src.rglob("*")):
        target = dst / path.relative_to(src)
        if path.is_dir() or target.exists() or ".ipynb_checkpoints" in path.parts:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        copied += 1
    return copied


def main() -> None:
    src = os.environ.get("WORKBENCH_NOTEBOOKS")
    if src and Path(src).is_dir():
        copy_missing(Path(src), Path.home() / "notebooks")
    command = ["jupyterhub-singleuser", *sys.argv[1:]]
    bindir = Path(sys.executable).parent  # the hub's environment, whatever the user's PATH
    if (bindir / command[0]).exists():
        command[0] = str(bindir / command[0])
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()

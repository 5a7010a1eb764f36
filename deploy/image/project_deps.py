"""Print the requirements of pyproject.toml's [project] and the extras named, one per line, for
``pip install -r``: the Dockerfile installs them in a layer of their own.

Why it exists: the Dockerfile copies the whole repository before it installs the workbench, so
any change to any file reinstalls everything after that copy. Installing the dependencies first,
from pyproject.toml alone, keeps them in a cached layer that only a change to pyproject.toml
rebuilds; the workbench's own install then finds them satisfied.

    python deploy/image/project_deps.py pyproject.toml hf > deps.txt
"""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"{pyproject} has no extra {unknown}; it has {sorted(optional)}")
    return [*project["dependencies"], *(r for e in extras for r in optional[e])]


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print("\n".join(requirements(Path(sys.argv[1]), sys.argv[2:])))

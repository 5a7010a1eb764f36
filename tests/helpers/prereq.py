"""Tests that need a system daemon or root: skip only where the thing is truly missing, and
say what to install; in CI (``CI=true``) a missing prerequisite is a failure, never a skip,
because a skip there would hide the very paths these tests exist for."""

from __future__ import annotations

import os
import shutil

import pytest

APT_HINT = ("apt-get install -y slurmctld slurmd slurm-client munge openssh-server "
            "openssh-client")


def require(programs: list[str], root: bool = False, why: str = "") -> None:
    """Fail (CI) or skip (elsewhere) unless every program is on PATH (and we are root)."""
    missing = [p for p in programs if shutil.which(p) is None and not os.path.exists(p)]
    problems = []
    if missing:
        problems.append(f"missing {', '.join(missing)} (install: {APT_HINT})")
    if root and os.geteuid() != 0:
        problems.append("needs root (network namespaces, daemons)")
    if not problems:
        return
    require_or_skip(f"{why}: " + "; ".join(problems) if why else "; ".join(problems))


def require_or_skip(message: str) -> None:
    """A prerequisite named by ``message`` is missing: fail in CI, skip elsewhere."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI must run this test: {message}")
    pytest.skip(message)

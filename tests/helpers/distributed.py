"""Real ranks for tests: the runtime's own launcher and rank pools, and the context a test's
rank function builds its plan on.

Rank functions run inside long-lived pool processes (the ``ranks`` fixture of ``conftest.py``),
so they build contexts on one ``Collectives`` per process, as a notebook rank does on its
session's: rerunning a plan reuses its process groups instead of piling up new ones.
"""

from __future__ import annotations

from kernels_runtime.comm import Collectives
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.testing import RankPool, RanksFailedError, run_ranks

__all__ = ["RankPool", "RanksFailedError", "context", "process_comm", "run_ranks"]

_comm: list[Collectives] = []  # this rank process's collectives (test helper state)


def process_comm() -> Collectives:
    """One ``Collectives`` per rank process, created on first use."""
    if not _comm:
        _comm.append(Collectives(timeout_s=30.0))
    return _comm[0]


def context(plan: str) -> ParallelContext:
    """``ParallelContext.build(plan, comm)`` on this process's collectives (cached groups)."""
    return ParallelContext.build(plan, process_comm())

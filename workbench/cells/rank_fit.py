"""``fit_ranks``: how many CPU ranks this machine (or container) holds, for a notebook's pool.

Every example notebook starts a pool sized for the reader's machine: Binder gives 2 GiB, a
laptop more. Each rank is a whole Python process with torch and transformers loaded (about
0.5 GiB), beside the kernel, the ipyparallel controller and the Jupyter server (about 1 GiB).
The limit is the container's cgroup limit where there is one (Binder, JupyterHub, Kubernetes),
else the machine's memory. ``WORKBENCH_RANKS`` overrides the choice, so a test or a user picks
the pool size whatever the memory says.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GIB = 2**30
RANK_MEMORY = 0.5 * GIB  # one CPU rank (engine and nanny) with torch and transformers loaded
BASE_MEMORY = 1.0 * GIB  # the kernel, the ipyparallel controller and the Jupyter server
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


@dataclass(frozen=True)
class RankFit:
    """The chosen rank count and why; ``str()`` reads "4 ranks (3.8 GiB of memory)"."""

    ranks: int
    why: str
    memory: int  # bytes available to this notebook's processes
    rank_memory: float = RANK_MEMORY
    base_memory: float = BASE_MEMORY

    def need_gib(self, ranks: int) -> float:
        """GiB of memory the notebook's processes and a pool of ``ranks`` need."""
        return (self.base_memory + ranks * self.rank_memory) / GIB

    def __str__(self) -> str:
        return f"{self.ranks} rank{'s' if self.ranks != 1 else ''} ({self.why})"


def memory_limit() -> int:
    """The container's memory limit (Binder: 2 GiB) if there is one, else the machine's."""
    import psutil

    limit = psutil.virtual_memory().total
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


def fit_ranks(*choices: int, memory: int | None = None, rank_gib: float = RANK_MEMORY / GIB,
              base_gib: float = BASE_MEMORY / GIB) -> RankFit:
    """The largest of ``choices`` (rank counts, e.g. ``fit_ranks(8, 4, 2)``) whose pool fits
    in ``memory`` (default: ``memory_limit()``); the smallest choice when none fits, since a
    notebook runs its smallest plan anyway. ``WORKBENCH_RANKS`` wins over both. ``rank_gib``:
    what one rank of this notebook holds (more where each rank loads a real model);
    ``base_gib``: the kernel, controller and Jupyter server."""
    if not choices or any(not isinstance(n, int) or n < 1 for n in choices):
        raise ValueError(f"fit_ranks takes rank counts >= 1, e.g. fit_ranks(4, 2); got "
                         f"{choices!r}")
    memory = memory_limit() if memory is None else memory
    sizes = {"rank_memory": rank_gib * GIB, "base_memory": base_gib * GIB}
    chosen = os.environ.get("WORKBENCH_RANKS")
    if chosen:
        if not chosen.isdigit() or int(chosen) < 1:
            raise ValueError(f"WORKBENCH_RANKS={chosen!r}: set it to a rank count, e.g. 2")
        return RankFit(int(chosen), f"WORKBENCH_RANKS={chosen}", memory, **sizes)
    fitting = [n for n in choices if memory >= (base_gib + n * rank_gib) * GIB]
    return RankFit(max(fitting) if fitting else min(choices),
                   f"{memory / GIB:.1f} GiB of memory", memory, **sizes)

"""The pool's table of ranks and what can be asked about it: dead or alive, why a dead one
ended, and a status row per rank (host, ``local_rank``, pid, device, backend, memory,
idle/busy/dead).

Why apart from ``pool.py``: these are queries, not lifecycle; they read what the launcher
knows (the local launcher's exit codes, the Slurm job's state) and what the ranks report.
A ``Pool`` holds one ``RankQueries`` (``pool.ranks``), which owns the state it reads: the
rank table (engine ids, descriptions, hosts, engine sets) and the cluster and client the pool
attaches while it runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workbench.errors import PoolError, describe_exit
from workbench.pool import rank_calls
from workbench.pool.forked_ranks import exit_status
from workbench.pool.slurm import job_state


@dataclass
class RankStatus:
    """One row of ``Pool.status()``."""

    rank: int
    engine_id: int
    host: str
    pid: int
    device: str
    backend: str
    state: str  # "idle" | "busy" | "dead"
    memory: dict[str, int] = field(default_factory=dict)
    local_rank: int = 0

_COMPLETING_S = 8.0  # how long a Slurm job may stay COMPLETING before we say so


class RankQueries:
    """The rank table of a ``Pool`` and its status queries (see the module doc).

    ``publish(busy, dead)`` is called after every ``status()`` with the ranks it found busy
    and dead, so the pool can publish its rows; the pool sets ``cluster`` and ``client`` while
    it runs and fills the table when ranks join.
    """

    def __init__(self, launcher: Any,
                 publish: Callable[[frozenset[int], frozenset[int]], None] | None = None) -> None:
        self.launcher = launcher  # a workbench.pool.launchers.LauncherSpec
        self.publish = publish
        self.cluster: Any = None  # ipp.Cluster while the pool runs
        self.client: Any = None  # ipp.Client while the pool runs
        self.engine_ids: list[int] = []  # index = rank
        self.ranks_info: list[dict[str, Any]] = []  # RankSession.describe() per rank
        self.hosts: list[str] = []  # per rank
        self.engine_sets: list[str] = []  # ipyparallel engine-set ids, in start order

    @property
    def started(self) -> bool:
        return self.client is not None and bool(self.engine_ids)

    def require_started(self) -> None:
        if not self.started:
            raise PoolError(
                "no pool is running: start one with `%colossal start` or Pool().start()"
            )

    def clear(self) -> None:
        """Forget the ranks and engine sets (the cluster stopped or is being replaced)."""
        self.engine_ids, self.ranks_info, self.engine_sets = [], [], []

    def slurm_jobs(self) -> list[str]:
        """Ids of the Slurm jobs holding this pool's engines (none for other launchers)."""
        if self.cluster is None or self.launcher.engines != "slurm":
            return []
        sets = [self.cluster.engines.get(s) for s in self.engine_sets]
        return [str(s.job_id) for s in sets if s is not None and getattr(s, "job_id", "")]

    def dead_ranks(self) -> list[int]:
        """Ranks whose engine has unregistered (died or was stopped)."""
        if self.client is None:
            return []
        alive = set(self.client.ids)
        return [r for r, e in enumerate(self.engine_ids) if e not in alive]

    def exit_code_of(self, rank: int, wait_s: float = 2.0) -> int | None:
        """Exit status of a dead rank's process, from the local launcher (None if unknown):
        the forking parent's record, or ipyparallel's per-engine stop data."""
        if self.cluster is None or not self.ranks_info:
            return None
        pid = self.ranks_info[rank]["pid"]
        deadline = time.monotonic() + wait_s
        while True:
            code = exit_status(self.cluster.profile_dir, self.cluster.cluster_id, pid)
            if code is not None:
                return code
            for engine_set in self.cluster.engines.values():
                stopped = getattr(engine_set, "stop_data", None) or {}
                for data in (stopped.get("engines") or {}).values():
                    if data.get("pid") == pid and data.get("exit_code") is not None:
                        return data["exit_code"]
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def death_reason(self, rank: int, wait_s: float = 2.0) -> str:
        """How a dead rank's process ended, as far as its launcher can tell: the exit signal
        or status (engines on this host), the Slurm job's state (say, CANCELLED), else
        'exit status unknown'."""
        deadline = time.monotonic() + wait_s
        while self.slurm_jobs():
            jobs = [job_state(j) for j in self.slurm_jobs()]
            over = [j for j in jobs if j.state != "RUNNING"]
            final = [j for j in over if j.state != "COMPLETING"]
            if final:
                return final[0].describe()
            # COMPLETING: the job's tasks are still exiting (engines unwinding a cell after a
            # SIGTERM); its final state (CANCELLED, TIMEOUT, ...) comes within seconds
            if time.monotonic() > deadline + (_COMPLETING_S if over else 0.0):
                return over[0].describe() if over else \
                    "exit status unknown; its Slurm job is still running"
            time.sleep(0.1)
        if self.launcher.engines != "local":  # only our forking parent records exits promptly
            return describe_exit(self.exit_code_of(rank, 0.0))
        return describe_exit(self.exit_code_of(rank, wait_s))

    def host_of(self, rank: int) -> str:
        return self.hosts[rank] if rank < len(self.hosts) else ""

    def status(self, timeout_s: float = 5.0) -> list[RankStatus]:
        """Per rank: host, pid, device, backend, memory in use, and idle, busy or dead."""
        self.require_started()
        dead = set(self.dead_ranks())
        live = [e for r, e in enumerate(self.engine_ids) if r not in dead]
        queues = self.client.queue_status(targets=live, verbose=False) if live else {}
        rows = []
        for r, eid in enumerate(self.engine_ids):
            info = dict(self.ranks_info[r])
            if r in dead:
                state = "dead"
            else:
                q = queues.get(eid, {})
                state = "busy" if q.get("queue", 0) + q.get("tasks", 0) > 0 else "idle"
            if state == "idle":
                ar = self.client[eid].apply_async(rank_calls.describe_rank)
                if ar.wait(timeout_s):
                    info = ar.get()
                    self.ranks_info[r] = info
            elif state == "busy":
                info["memory"] = _local_memory(info) or info.get("memory", {})
            rows.append(
                RankStatus(
                    rank=r, engine_id=eid, host=info["host"], pid=info["pid"],
                    device=info["device"], backend=info["backend"], state=state,
                    memory=info.get("memory", {}), local_rank=info.get("local_rank", 0),
                )
            )
        if self.publish is not None:
            self.publish(frozenset(r.rank for r in rows if r.state == "busy"), frozenset(dead))
        return rows


def _local_memory(info: dict[str, Any]) -> dict[str, int] | None:
    """Host RSS of a rank on this machine, readable while the rank is busy."""
    import socket

    import psutil

    if info.get("host") != socket.gethostname():
        return None
    try:
        rss = psutil.Process(info["pid"]).memory_info().rss
    except psutil.Error:
        return None
    return {**info.get("memory", {}), "host_rss": rss}


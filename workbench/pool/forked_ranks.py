"""Local engines forked from one process that imported torch once.

Why: on one host, a pool's start is dominated by every rank importing torch (about 1.3 s of
CPU each); four ranks on two cores pay it four times over. ``ForkedEngineSetLauncher`` is an
ipyparallel engine-set launcher (like its MPI launcher: one process it starts and stops, many
engines) that runs ``python -m workbench.pool.rank_process --workbench-fork=N``: that process
imports the rank runtime, then forks N children, each an unchanged ipyparallel engine with its
own nanny.
The children share the imported pages copy-on-write, and no CUDA context exists before the
fork (importing torch creates none), so each child starts clean; on a GPU host each child gets
its own ``CUDA_VISIBLE_DEVICES`` before anything reads it.

The parent forwards SIGTERM and SIGINT to the children (SIGKILL for those still alive a grace
period after a SIGTERM, or once the parent's own parent, the kernel, is gone), reaps them and
appends each exit status to ``$IPP_PROFILE_DIR/log/engine-exits-$IPP_CLUSTER_ID.jsonl``, which
is how the pool still says "killed by SIGKILL" for a rank of this launcher (``exit_status``).
Children die with the parent (``PR_SET_PDEATHSIG``), so stopping the set never leaves an
engine behind.
Remote launchers (SSH, Slurm, MPI) start one engine per process, as ipyparallel does.
"""

from __future__ import annotations

import json
import os

from ipyparallel.cluster.launcher import EngineLauncher, LocalProcessLauncher
from traitlets import List, Unicode

FORK_OPTION = "--workbench-fork="
DEVICES_OPTION = "--workbench-devices="


class ForkedEngineSetLauncher(LocalProcessLauncher, EngineLauncher):
    """Start ``n`` engines as children of one process (see the module doc)."""

    devices = List(Unicode(), config=True,
                   help="CUDA_VISIBLE_DEVICES of each engine, round robin (empty: unset)")

    def find_args(self) -> list[str]:
        extra = [f"{DEVICES_OPTION}{','.join(self.devices)}"] if self.devices else []
        return [*self.engine_cmd, f"{FORK_OPTION}{self.n}", *extra, *self.engine_args]

    def start(self, n: int) -> None:
        self.n = n
        return super().start()


def exits_file(profile_dir: str, cluster_id: str) -> str:
    return os.path.join(profile_dir, "log", f"engine-exits-{cluster_id}.jsonl")


def exit_status(profile_dir: str, cluster_id: str, pid: int) -> int | None:
    """The exit status the forking parent recorded for engine ``pid`` (None: not yet)."""
    try:
        with open(exits_file(profile_dir, cluster_id)) as f:
            for line in f:
                record = json.loads(line)
                if record.get("pid") == pid:
                    return record.get("exit_code")
    except (OSError, ValueError):
        return None
    return None

"""What a pool leaves behind and who removes it: spill folders of ranks that died, and the
reaper's list of what to stop should the kernel die (``workbench.pool.reaper``).

Why apart from ``pool.py``: the pool starts and stops processes; this is the cleanup of what
outlives them (a SIGKILLed rank's spill folder, a cluster whose kernel was SIGKILLed). Both
functions log and carry on when cleanup fails: cleaning up must never stop a pool.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import psutil

from kernels_runtime.memory.spill import remove_stale, spill_root
from workbench.pool.reaper import ReaperHandle

log = logging.getLogger("workbench.pool.pool")


def remove_dead_spill(pool_id: str) -> None:
    """Spill folders of this pool's ranks that died (a SIGKILL leaves them behind); other
    pools' folders and live ranks' stay. The default or ``WORKBENCH_SPILL_DIR`` root."""
    try:
        removed = remove_stale(spill_root(), pool_id)
    except OSError as e:  # cleaning up must never stop a restart
        log.warning("removing the dead ranks' spill folders failed: %s", e)
        return
    if removed:
        log.info("removed the spill folders of dead ranks: %s", removed)


def arm_reaper(reaper: ReaperHandle, cluster: Any, slurm_jobs: list[str], pool_id: str,
               log_dir: str) -> None:
    """Tell the reaper what to stop should this process die: the controller's and each
    engine set's process trees (``cluster``, an ``ipp.Cluster``), Slurm jobs, the pool's
    spill."""
    pids = []
    for launcher in [cluster.controller, *cluster.engines.values()]:
        proc = getattr(launcher, "process", None)
        if isinstance(proc, psutil.Process):
            with contextlib.suppress(psutil.Error):
                pids.append([proc.pid, proc.create_time()])
    targets = {"pids": pids, "slurm_jobs": slurm_jobs, "spill_root": str(spill_root()),
               "pool_id": pool_id}
    try:
        reaper.arm(targets, log_dir)
    except OSError as e:  # the pool still works; only its cleanup after a crash is lost
        log.warning("starting the pool's reaper failed: %s", e)

"""What Slurm says about the pool's engine job: pending (and why), running, or ended.

Why: ipyparallel's Slurm launcher submits the engines with ``sbatch`` and then knows nothing
more (its ``poll`` is not implemented). A job can wait in the queue for minutes, or be
cancelled under a running cell; the pool asks ``squeue`` (and ``scontrol`` once the job left
the queue) so that the notebook shows "pending (Resources)" instead of a silent wait, gives up
with Slurm's reason at the start timeout, and reports a cancelled job like dead ranks.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

# pending reasons that mean the job asks for more time than its partition, QOS or account
# allows: Slurm leaves such a job pending for ever instead of refusing it
TIME_LIMIT_REASONS = ("PartitionTimeLimit", "QOSMaxWallDurationPerJobLimit",
                      "AssocMaxWallDurationPerJobLimit", "AssocGrpWallLimit", "QOSGrpWallLimit")
ENDED = ("CANCELLED", "COMPLETED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
         "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


@dataclass(frozen=True)
class JobState:
    job_id: str
    state: str  # PENDING, RUNNING, CANCELLED, ... or UNKNOWN
    reason: str = ""

    @property
    def pending(self) -> bool:
        return self.state == "PENDING"

    @property
    def ended(self) -> bool:
        return self.state.split()[0] in ENDED

    def describe(self) -> str:
        """'Slurm job 12 pending (Resources)', 'Slurm job 12 CANCELLED', ..."""
        if self.pending:
            why = f" ({self.reason})" if self.reason else ""
            if self.reason in TIME_LIMIT_REASONS:
                from workbench.pool.launchers import SLURM_DEFAULT_TIME

                why += (f": its time limit (--time={SLURM_DEFAULT_TIME} unless the options set "
                        "one) exceeds what the cluster allows here; give a shorter one with "
                        "--launcher-option=--time=HH:MM:SS")
            return f"Slurm job {self.job_id} pending{why}"
        return f"Slurm job {self.job_id} {self.state}"


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


def job_state(job_id: str) -> JobState:
    """The job's state and reason from ``squeue``, or from ``scontrol`` after it left the
    queue (Slurm keeps ended jobs there for MinJobAge); UNKNOWN when neither knows it."""
    line = _run(["squeue", "-h", "-j", str(job_id), "-o", "%T|%r"]).strip()
    if line:
        state, _, reason = line.partition("|")
        return JobState(str(job_id), state, "" if reason == "None" else reason)
    fields = dict(
        item.split("=", 1)
        for item in _run(["scontrol", "-o", "show", "job", str(job_id)]).split()
        if "=" in item
    )
    state = fields.get("JobState", "UNKNOWN")
    reason = fields.get("Reason", "")
    return JobState(str(job_id), state, "" if reason == "None" else reason)


def watch_message(jobs: list[JobState], log_dir: str) -> str:
    """What a start waiting for these jobs shows ("Slurm job 12 pending (Resources)"); a job
    that ended cannot start engines any more, so that is an error naming its state."""
    from workbench.errors import PoolError

    ended = [j for j in jobs if j.ended]
    if ended:
        raise PoolError(f"{ended[0].describe()} before its engines registered; see the "
                        f"engine log in {log_dir}")
    return "; ".join(j.describe() for j in jobs if j.pending)


def timeout_message(got: int, n: int, timeout_s: float, jobs: list[JobState],
                    log_dir: str) -> str:
    """Why a start gave up: a job still pending (with Slurm's reason), or too few engines."""
    pending = [j for j in jobs if j.pending]
    if pending:
        return (f"{pending[0].describe()} after the start timeout of {timeout_s:g} s; the job "
                "was cancelled. Wait longer with --start-timeout S (Pool(start_timeout_s=...)) "
                "or ask for resources the cluster has free")
    return (f"only {got} of {n} engines registered within {timeout_s:g} s; see the engine "
            f"logs in {log_dir}")

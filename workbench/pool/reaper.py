"""The pool's reaper: a small process that stops the pool's cluster when its kernel dies.

Why it exists: Jupyter kills a slow kernel with SIGKILL at shutdown, and a SIGKILLed kernel
runs no ``atexit`` and no ``Pool.stop``. ipyparallel starts the controller and every engine set
in sessions of their own (signals to the kernel's process group do not reach them), so without
this process they outlive the kernel: the controller waits for clients forever, the engines
serve it, a Slurm job holds its nodes. The reaper is started by the pool beside the cluster,
also in a session of its own, watches the kernel's pid and, once the kernel is gone:

1. sends SIGTERM to every process of the pool's tree (controller, forked engine parents,
   engines, their nannies: the tree is read before anything is signalled, since a dead
   parent's children are re-parented), waits ``grace_s`` and SIGKILLs what is left;
2. cancels the pool's Slurm jobs (``scancel``);
3. removes the pool's spill folders (those of ranks that are no longer running).

What to stop is read from a small JSON file the pool rewrites on start and restart
(``write_targets``): {"pids": [[pid, create_time], ...], "slurm_jobs": [...],
"spill_root": ..., "pool_id": ...}. The pool removes that file on a clean stop, which tells
the reaper to leave without touching anything.

It runs as a script (``python reaper.py --watch PID --targets FILE``) and imports only the
standard library, psutil and the runtime's spill helpers, so it starts in a fraction of a
second and holds little memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

POLL_S = 0.25
GRACE_S = 5.0


def write_targets(path: str, targets: dict[str, Any]) -> None:
    """Write what the reaper stops, atomically (it may read the file at any moment)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(targets, f)
    os.replace(tmp, path)


def start(targets_file: str, log_file: str, grace_s: float = GRACE_S) -> subprocess.Popen:
    """Start a reaper watching this process; it reads ``targets_file`` when this process dies."""
    here = Path(__file__).resolve()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(here.parent.parent),
                                                    env.get("PYTHONPATH", "")) if p)
    with open(log_file, "ab") as log, open(os.devnull, "rb") as stdin:
        return subprocess.Popen(
            [sys.executable, str(here), "--watch", str(os.getpid()), "--targets", targets_file,
             "--grace", str(grace_s)],
            stdin=stdin, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,  # neither the kernel's interrupt nor its group kill reach it
        )


class ReaperHandle:
    """The pool's side: one reaper per pool, started on the first ``arm``; ``arm`` again after
    a restart rewrites what it stops; ``disarm`` (a clean stop) lets it leave untouched."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.proc: subprocess.Popen | None = None
        self.targets_file: str | None = None

    def arm(self, targets: dict[str, Any], log_dir: str) -> None:
        if self.targets_file is None:
            fd, self.targets_file = tempfile.mkstemp(prefix="colossal-reaper-", suffix=".json")
            os.close(fd)
        write_targets(self.targets_file, targets)
        if self.proc is None or self.proc.poll() is not None:
            os.makedirs(log_dir, exist_ok=True)
            self.proc = start(self.targets_file, os.path.join(log_dir, "reaper.log"),
                              self.grace_s)

    def disarm(self) -> None:
        if self.targets_file is not None:
            with contextlib.suppress(OSError):
                os.remove(self.targets_file)
            self.targets_file = None
        proc, self.proc = self.proc, None
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(2 * POLL_S + 1.0)  # it leaves by itself once the file is gone
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _alive(proc: psutil.Process) -> bool:
    """A process counts as gone once it exited, even while a zombie waits for its parent."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _watched_gone(watched: psutil.Process, parent: int) -> bool:
    # our parent is the kernel: a changed parent pid says it died even before it is reaped
    return os.getppid() != parent or not _alive(watched)


def _tree(pids: list[list[float]]) -> list[psutil.Process]:
    """The recorded processes (those still the same process: pid and start time) and all
    their descendants, read before any of them is signalled."""
    found: dict[int, psutil.Process] = {}
    for pid, created in pids:
        try:
            proc = psutil.Process(int(pid))
            if abs(proc.create_time() - created) > 1.0:  # the pid was reused
                continue
            for p in [proc, *proc.children(recursive=True)]:
                found[p.pid] = p
        except psutil.Error:
            continue
    found.pop(os.getpid(), None)
    return list(found.values())


def stop_tree(procs: list[psutil.Process], grace_s: float) -> list[int]:
    """SIGTERM ``procs``, wait up to ``grace_s``, SIGKILL the rest. Returns the killed pids."""
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5.0)
    return [p.pid for p in alive]


def _cancel_jobs(jobs: list[str]) -> None:
    for job in jobs:
        try:
            subprocess.run(["scancel", str(job)], timeout=30, check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            print(f"reaper: scancel {job} failed: {e}", flush=True)


def _remove_spill(root: str | None, pool_id: str | None, wait_s: float = 20.0) -> None:
    """Remove the pool's rank folders once their owners are gone: a cancelled Slurm job's
    ranks take a moment to end, so this retries for up to ``wait_s``."""
    if not root or not pool_id:
        return
    from kernels_runtime.memory.spill import remove_stale

    folder = Path(root) / pool_id
    deadline = time.monotonic() + wait_s
    while folder.exists():
        try:
            removed = remove_stale(Path(root), pool_id)
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty: a live rank's folder stays
        except OSError as e:
            print(f"reaper: removing spill folders failed: {e}", flush=True)
            return
        if removed:
            print(f"reaper: removed spill folders {[str(r) for r in removed]}", flush=True)
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)


def reap(targets: dict[str, Any], grace_s: float) -> None:
    """Stop everything ``targets`` names (see the module doc)."""
    killed = stop_tree(_tree(targets.get("pids", [])), grace_s)
    if killed:
        print(f"reaper: SIGKILLed {killed} after {grace_s} s", flush=True)
    _cancel_jobs(targets.get("slurm_jobs", []))
    _remove_spill(targets.get("spill_root"), targets.get("pool_id"))


def watch(pid: int, targets_file: str, grace_s: float) -> int:
    try:
        watched = psutil.Process(pid)
    except psutil.NoSuchProcess:
        watched = None
    parent = os.getppid()
    while True:
        if not os.path.exists(targets_file):
            return 0  # the pool stopped cleanly
        if watched is None or _watched_gone(watched, parent):
            break
        time.sleep(POLL_S)
    try:
        with open(targets_file) as f:
            targets = json.load(f)
    except (OSError, ValueError):
        return 0  # removed while we looked: a clean stop
    print(f"reaper: process {pid} is gone; stopping its pool", flush=True)
    reap(targets, grace_s)
    with contextlib.suppress(OSError):
        os.remove(targets_file)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="stop a pool's cluster when its kernel dies")
    parser.add_argument("--watch", type=int, required=True, help="the kernel's pid")
    parser.add_argument("--targets", required=True, help="the JSON file naming what to stop")
    parser.add_argument("--grace", type=float, default=GRACE_S,
                        help="seconds between SIGTERM and SIGKILL")
    args = parser.parse_args(argv)
    return watch(args.watch, args.targets, args.grace)


if __name__ == "__main__":
    sys.exit(main())

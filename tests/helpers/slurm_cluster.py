"""A real Slurm cluster for tests: Debian's munged, slurmctld and one slurmd per node.

Why real daemons: what the pool must get right with Slurm is what Slurm does (a job waiting in
the queue with a reason, ``srun`` placing tasks on nodes, ``scancel`` killing them); only the
real scheduler shows it. Each cluster gets its own configuration file, state, spool and log
folders under a temporary folder and its own ports, and is torn down (jobs cancelled, daemons
terminated) when the test is done. Nodes may live in other network namespaces: a node's
``wrap`` is the argv prefix that runs a program on that host (see ``helpers.hosts``).
Clients (sbatch, squeue, scancel, and the pool's launcher) find the cluster through
``SLURM_CONF``, set by ``env()``.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from kernels_runtime.comm import find_free_port

MUNGE_SOCKET = "/run/munge/munge.socket.2"


@dataclass
class SlurmNode:
    name: str
    addr: str
    cpus: int
    wrap: list[str] = field(default_factory=list)


def ensure_munge() -> bool:
    """Start munged as the munge user unless one already answers (it is shared: one per
    machine, like a cluster's shared key); True when this call started it."""
    if _munge_ok():
        return False
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    subprocess.run(["chown", "munge:munge", "/run/munge"], check=True)
    subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
    deadline = time.monotonic() + 10
    while not _munge_ok():
        if time.monotonic() > deadline:
            raise RuntimeError("munged did not come up")
        time.sleep(0.1)
    return True


def _munge_ok() -> bool:
    if not os.path.exists(MUNGE_SOCKET):
        return False
    cred = subprocess.run(["munge", "-n"], capture_output=True)
    return cred.returncode == 0 and subprocess.run(
        ["unmunge"], input=cred.stdout, capture_output=True).returncode == 0


class SlurmCluster:
    """slurmctld on ``controller`` and slurmd on every node; ``start()`` waits until the
    nodes are idle, ``stop()`` cancels every job and stops the daemons."""

    def __init__(self, workdir: Path, controller: SlurmNode, nodes: list[SlurmNode]) -> None:
        self.dir, self.controller, self.nodes = workdir, controller, nodes
        self.conf = workdir / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.started_munge = False

    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def write_config(self) -> None:
        d = self.dir
        for sub in ("state", "log", *(f"spool-{n.name}" for n in self.nodes)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        ctl = self.controller
        lines = [
            "ClusterName=workbench", f"SlurmctldHost={ctl.name}({ctl.addr})",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
            f"SlurmctldPort={find_free_port()}", f"SlurmdPort={find_free_port()}",
            f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool-%n",
            f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log", f"SlurmdLogFile={d}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill", "MpiDefault=none", "ReturnToService=2",
            "SlurmdParameters=config_overrides", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "MinJobAge=300",
            "SlurmdTimeout=30", "InactiveLimit=0", "KillWait=2", "SchedulerParameters="
            "sched_interval=2",
        ]
        lines += [f"NodeName={n.name} NodeAddr={n.addr} CPUs={n.cpus} State=UNKNOWN"
                  for n in self.nodes]
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def start(self, timeout_s: float = 60.0) -> SlurmCluster:
        self.started_munge = ensure_munge()
        self.write_config()
        env = dict(os.environ, **self.env())
        log = open(self.dir / "log" / "daemons.out", "ab")  # noqa: SIM115 (kept by Popen)
        self.procs.append(subprocess.Popen(
            [*self.controller.wrap, "/usr/sbin/slurmctld", "-D", "-i", "-f", str(self.conf)],
            env=env, stdout=log, stderr=log))
        for node in self.nodes:
            self.procs.append(subprocess.Popen(
                [*node.wrap, "/usr/sbin/slurmd", "-D", "-f", str(self.conf), "-N", node.name],
                env=env, stdout=log, stderr=log))
        self.wait_idle(timeout_s)
        return self

    def run(self, *argv: str, check: bool = True) -> str:
        """A Slurm client command against this cluster (sinfo, scontrol, squeue, scancel),
        run on the controller's host."""
        done = subprocess.run([*self.controller.wrap, *argv], text=True, capture_output=True,
                              env=dict(os.environ, **self.env()), timeout=30)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
        return done.stdout

    def wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        states = ""
        while time.monotonic() < deadline:
            dead = [p.args for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"Slurm daemon exited: {dead[0]}; logs in {self.dir}/log")
            states = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            if states and all(line.split()[1] == "idle" for line in states.splitlines()):
                return
            time.sleep(0.5)
        raise RuntimeError(f"Slurm nodes not idle after {timeout_s} s: {states!r}; logs in "
                           f"{self.dir}/log")

    def set_node_state(self, node: str, state: str, reason: str = "test") -> None:
        extra = [f"Reason={reason}"] if state.upper() in ("DRAIN", "DOWN") else []
        self.run("scontrol", "update", f"NodeName={node}", f"State={state}", *extra)

    def stop(self) -> None:
        self.run("scancel", "--full", "--user=root", check=False)
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        if self.started_munge:
            subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged", "--stop"],
                           capture_output=True)
            self.started_munge = False

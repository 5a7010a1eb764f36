"""What one rank knows about itself while a pool drives it.

A pool of long-lived ranks outlives any single cell, so the per-rank state (the process group,
the instrumented collectives, the plan of the current cell, the telemetry, the cached process
groups of every mesh built so far) lives in one ``RankSession`` object held in the engine's
namespace, never in module globals. The same object can be built by a plain ``torchrun``
script through :meth:`RankSession.from_env`.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kernels_runtime.comm import (
    Collectives,
    CommStats,
    DistributedState,
    destroy_distributed,
    find_free_port,
    init_distributed,
)
from kernels_runtime.launcher_env import host_address
from kernels_runtime.mesh.cache import MeshCache
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.plan import Plan
from kernels_runtime.telemetry import Telemetry


@dataclass
class RankSession:
    """Per-rank state: distributed process group, collectives, and the plan in force."""

    state: DistributedState
    comm: Collectives
    plan: Any = None
    broken: bool = False
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.state.rank

    @property
    def world_size(self) -> int:
        return self.state.world_size

    @property
    def device(self):
        return self.state.accelerator.device

    @property
    def telemetry(self) -> Telemetry:
        """This rank's one ``Telemetry``, carried by ``comm`` so that every ``ParallelContext``
        built from it records into it. Pool engines publish it to the notebook; under torchrun
        it only counts (``telemetry.snapshot()``)."""
        return self.comm.telemetry

    def __post_init__(self) -> None:
        acc = self.state.accelerator
        self.comm.telemetry.configure(memory=acc.memory_in_use, device_timer=acc.device_timer())
        if self.comm.meshes is None:
            self.comm.meshes = MeshCache()

    def context(self, plan: Plan | str | None = None) -> ParallelContext:
        """The ``ParallelContext`` of ``plan`` (default: the cell's plan), on cached groups:
        the same as ``ParallelContext.build(plan, session.comm)``."""
        chosen = plan if plan is not None else self.plan
        return ParallelContext.build(chosen if chosen is not None else Plan(), self.comm)

    @classmethod
    def start(
        cls,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        backend: str | None = None,
        timeout_s: float = 60.0,
        local_rank: int | None = None,
        local_world_size: int = 1,
    ) -> RankSession:
        """Join the process group; blocks until every rank has joined (or ``timeout_s``).

        CPU ranks on one host share its cores: unless OMP_NUM_THREADS says otherwise, each
        gets cores / ranks-on-this-host intra-op threads (torchrun does the same), because
        oversubscribed ranks stall each other at every collective."""
        state = init_distributed(
            rank, world_size, master_addr, master_port, backend, timeout_s, local_rank
        )
        _share_cores(state, local_world_size)
        exported = export_environment(state, master_port, local_world_size)
        session = cls(state=state, comm=Collectives(CommStats(), timeout_s=timeout_s))
        session.extras["environment"] = exported
        return session

    @classmethod
    def from_env(cls, timeout_s: float = 60.0) -> RankSession:
        """Build from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

        torchrun's agent already serves the rendezvous store on MASTER_PORT, so ranks join it
        as clients instead of starting a second store there."""
        env = os.environ
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        addr, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500"))
        store = None
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            store = dist.TCPStore(addr, port, world, False, timeout=timedelta(seconds=timeout_s))
            store = dist.PrefixStore(f"workbench/{env.get('TORCHELASTIC_RESTART_COUNT', 0)}/",
                                     store)
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        state = init_distributed(rank, world, addr, port, None, timeout_s,
                                 int(env.get("LOCAL_RANK", rank)), store=store)
        _share_cores(state, local_world)
        return cls(state=state, comm=Collectives(CommStats(), timeout_s=timeout_s))

    def recreate_group(self, master_port: int) -> None:
        """Re-create the process group on a new port.

        After an interrupted or timed-out collective a process group is unusable, and every
        later collective would fail; every rank calls this together to get a fresh group.
        """
        s = self.state
        self.comm.meshes.clear()  # their groups die with the default group
        self.state = init_distributed(
            s.rank, s.world_size, s.master_addr, master_port, s.backend, s.timeout_s, s.local_rank
        )
        self.extras["environment"] = export_environment(
            self.state, master_port, int(os.environ.get("LOCAL_WORLD_SIZE", s.world_size)))
        self.comm.timeout_s = s.timeout_s
        self.broken = False

    def restore_environment(self) -> None:
        """Export again the variables ``export_environment`` set (a pool rank runs this
        before every cell): a library may delete them when it finishes, as Lightning's
        ``LightningEnvironment.teardown`` deletes ``WORLD_SIZE`` at the end of ``fit``, and
        the next cell's ``Trainer`` must still find the pool's group."""
        os.environ.update(self.extras.get("environment", {}))

    def close(self) -> None:
        self.comm.meshes.clear()
        destroy_distributed()

    def describe(self) -> dict[str, Any]:
        """A picklable status record of this rank (host, pid, device, backend, memory)."""
        acc = self.state.accelerator
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "local_rank": self.state.local_rank,
            "master_addr": self.state.master_addr,
            "device": str(acc.device),
            "backend": self.state.backend,
            "memory": acc.memory_in_use(),
            "comm": self.comm.stats.totals(),
        }


def export_environment(state: DistributedState, master_port: int,
                       local_world_size: int) -> dict[str, str]:
    """torchrun's variables for this rank's group, so code written for torchrun (HF
    ``Trainer``, ``accelerate``, Lightning) run in a cell finds the pool's group: these
    libraries read ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` to decide they are distributed, and
    use the default group that already exists instead of creating a second one. Returns
    what it set.

    It also removes the prompt markers (``sys.ps1``..``ps3``) the engine's IPython shell sets
    "so that scripts can decide if they are running interactively": a rank is a launched
    worker, as under torchrun, and Lightning reads ``sys.ps1`` to refuse
    ``Trainer(strategy="ddp")`` in a notebook (where it would have to launch processes)."""
    values = {
        "RANK": str(state.rank), "WORLD_SIZE": str(state.world_size),
        "LOCAL_RANK": str(state.local_rank), "LOCAL_WORLD_SIZE": str(local_world_size),
        "MASTER_ADDR": state.master_addr, "MASTER_PORT": str(master_port),
    }
    os.environ.update(values)
    for prompt in ("ps1", "ps2", "ps3"):
        sys.__dict__.pop(prompt, None)
    return values


def _share_cores(state: DistributedState, local_world_size: int) -> None:
    if state.accelerator.kind == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world_size)))


def rendezvous_address(local: bool) -> tuple[str, int]:
    """Address and a free port on this (rank 0's) host for the others to join.

    ``local`` pools (every rank on this host) use the loopback address; multi-host pools use
    the address this host's name resolves to, since the other ranks connect over the network.
    """
    return host_address(local, find_free_port)

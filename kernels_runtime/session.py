"""What one rank knows about itself while a pool drives it.

A pool of long-lived ranks outlives any single cell, so the per-rank state (the process group,
the instrumented collectives, the plan of the current cell) lives in one ``RankSession`` object
held in the engine's namespace, never in module globals. The same object can be built by a plain
``torchrun`` script through :meth:`RankSession.from_env`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

from kernels_runtime.comm import (
    Collectives,
    CommStats,
    DistributedState,
    destroy_distributed,
    find_free_port,
    init_distributed,
)


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
    ) -> RankSession:
        """Join the process group; blocks until every rank has joined (or ``timeout_s``)."""
        state = init_distributed(
            rank, world_size, master_addr, master_port, backend, timeout_s, local_rank
        )
        return cls(state=state, comm=Collectives(CommStats(), timeout_s=timeout_s))

    @classmethod
    def from_env(cls, timeout_s: float = 60.0) -> RankSession:
        """Build from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
        env = os.environ
        return cls.start(
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            env.get("MASTER_ADDR", "127.0.0.1"),
            int(env.get("MASTER_PORT", "29500")),
            timeout_s=timeout_s,
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
        )

    def recreate_group(self, master_port: int) -> None:
        """Re-create the process group on a new port.

        After an interrupted or timed-out collective gloo and nccl groups are unusable, and every
        later collective would fail; every rank calls this together to get a fresh group.
        """
        s = self.state
        self.state = init_distributed(
            s.rank, s.world_size, s.master_addr, master_port, s.backend, s.timeout_s, s.local_rank
        )
        self.comm.timeout_s = s.timeout_s
        self.broken = False

    def close(self) -> None:
        destroy_distributed()

    def describe(self) -> dict[str, Any]:
        """A picklable status record of this rank (host, pid, device, backend, memory)."""
        acc = self.state.accelerator
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "device": str(acc.device),
            "backend": self.state.backend,
            "memory": acc.memory_in_use(),
            "comm": self.comm.stats.totals(),
        }


def rendezvous_address(local: bool) -> tuple[str, int]:
    """Address and a free port on this (rank 0's) host for the others to join.

    ``local`` pools use the loopback address; multi-node pools use this host's resolvable
    address, since the other ranks connect to it over the network.
    """
    if local:
        return "127.0.0.1", find_free_port("127.0.0.1")
    host = socket.getfqdn()
    addr = socket.gethostbyname(host)
    return addr, find_free_port("0.0.0.0")

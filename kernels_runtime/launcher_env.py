"""What the process launcher told this rank: MPI's or Slurm's rank and local rank, and the
rendezvous address broadcast over MPI.

Why: on a cluster the launcher already knows where each process runs. Under ``mpiexec`` every
process has an MPI rank and a rank among the processes of its host; under ``srun`` the same
comes as ``SLURM_PROCID`` / ``SLURM_LOCALID``. The notebook's pool reads them to number ranks
as the launcher did (ranks of one host stay adjacent, so tensor-parallel groups, the innermost
mesh axis, stay inside a host), and an MPI pool takes its torch.distributed rendezvous from MPI:
the process that becomes rank 0 picks an address and port, and MPI broadcasts it to the others.
Plain environment reads, no torch: usable from any engine or script.
"""

from __future__ import annotations

import os
from typing import Any

# (launcher, global rank, local rank, world size) variables, first match wins
_SOURCES = (
    ("mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("mpi", "PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE"),  # MPICH / Hydra
    ("slurm", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),
)


def launcher_rank(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """``{"launcher": "mpi"|"slurm"|"", "launcher_rank": int|None, "launcher_local_rank":
    int|None, "launcher_size": int|None}`` from the launcher's environment variables."""
    env = os.environ if environ is None else environ
    for name, rank, local, size in _SOURCES:
        if rank in env:
            return {
                "launcher": name,
                "launcher_rank": int(env[rank]),
                "launcher_local_rank": int(env[local]) if local in env else None,
                "launcher_size": int(env[size]) if size in env else None,
            }
    return {"launcher": "", "launcher_rank": None, "launcher_local_rank": None,
            "launcher_size": None}


def mpi_rendezvous(root: int, loopback: bool) -> tuple[str, int]:
    """Every MPI process calls this together: MPI rank ``root`` picks a free address and port
    on its host (loopback when all ranks share it) and MPI broadcasts it to all."""
    from mpi4py import MPI

    from kernels_runtime.comm import find_free_port

    comm = MPI.COMM_WORLD
    chosen = None
    if comm.Get_rank() == root:
        chosen = host_address(loopback, find_free_port)
    return comm.bcast(chosen, root=root)


def host_address(loopback: bool, free_port: Any) -> tuple[str, int]:
    """This host's address for other ranks to join, and a free port on it.

    ``loopback`` when every rank runs on this host; otherwise the address this host's name
    resolves to, which is what other hosts reach it by (the cluster's /etc/hosts or DNS)."""
    import socket

    if loopback:
        return "127.0.0.1", free_port("127.0.0.1")
    addr = socket.gethostbyname(socket.getfqdn())
    if addr.startswith("127."):
        raise RuntimeError(
            f"this host's name {socket.getfqdn()!r} resolves to the loopback address {addr}, "
            "which other hosts cannot reach: map it to the host's network address in "
            "/etc/hosts or DNS"
        )
    return addr, free_port(addr)

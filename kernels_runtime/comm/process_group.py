"""Create, and re-create, the default process group of one engine.

A notebook outlives its process groups: an interrupted cell or a rank that skipped a collective
leaves the group unusable, and the pool repairs it by calling `init_distributed` again on every
rank. So this module is built for being called twice: it tears down whatever group exists first,
and it rendezvous through an explicit TCPStore (rank 0 hosts it) rather than environment
variables, so a new port per re-creation is just an argument.
"""

from __future__ import annotations

import gc
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kernels_runtime.comm.accelerator import Accelerator

# what a rendezvous store says when another process took its port between find_free_port and
# the bind: the caller picks another port and tries again
PORT_TAKEN = ("address already in use", "eaddrinuse")

def find_free_port(host: str = "127.0.0.1") -> int:
    """A port the OS just reported free. Another process may still take it before rank 0 binds
    it, so callers retry on "address already in use"."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class DistributedState:
    """What `init_distributed` set up, passed explicitly to whoever needs it (no globals)."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    accelerator: Accelerator
    master_addr: str
    master_port: int
    timeout_s: float


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str | None = None,
    timeout_s: float = 60.0,
    local_rank: int | None = None,
    *,
    store: dist.Store | None = None,
) -> DistributedState:
    """Join (or re-join) the default process group; every rank calls this with the same port.

    ``store`` replaces the TCPStore this function would create: under torchrun the agent
    already serves one at MASTER_ADDR:MASTER_PORT (see ``RankSession.from_env``).

    `backend=None` takes the accelerator's backend (nccl with a GPU, gloo without). `timeout_s`
    bounds the rendezvous and becomes the group's own collective timeout; keep it equal to the
    `Collectives` timeout, because a gloo collective abandoned by `Collectives` keeps running
    until this timeout, and tearing the group down waits for it.

    Re-creating: an existing default group is destroyed first. Use a fresh `master_port` each
    time; with the old port a fast rank can reach the previous store before rank 0 closes it.
    """
    local_rank = rank if local_rank is None else local_rank
    accelerator = Accelerator.detect(local_rank, prefer=backend)
    backend = backend or accelerator.backend
    destroy_distributed()
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(master_addr, master_port, world_size, rank == 0, timeout=timeout)
    extra: dict[str, torch.device] = {}
    if accelerator.queues_work:
        accelerator.bind()
        extra["device_id"] = accelerator.device  # eager communicator init, bound to this device
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **extra
    )
    return DistributedState(
        rank, world_size, local_rank, backend, accelerator, master_addr, master_port, timeout_s
    )


def init_single_process(timeout_s: float = 60.0, attempts: int = 3) -> DistributedState:
    """A private group of one rank on a free loopback port, for a plain Python process (no pool,
    no torchrun): the runtime then runs there exactly as on a pool of one rank, with the backend
    a one-rank pool would take (the accelerator's). Retries when the port is taken meanwhile."""
    for attempt in range(attempts):
        try:
            return init_distributed(0, 1, "127.0.0.1", find_free_port(), None, timeout_s)
        except RuntimeError as err:  # DistNetworkError is one
            if not any(m in str(err).lower() for m in PORT_TAKEN) or attempt + 1 == attempts:
                raise
    raise AssertionError("unreachable")


def destroy_distributed() -> None:
    """Tear down the default group and its subgroups; a no-op when none exists.

    With gloo this blocks while a collective abandoned after a timeout is still pending, until
    the peers tear down too or the group's own timeout fires. The garbage collection releases the
    old TCPStore (and its port) even when a stale reference cycle still points at it.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()

"""Create, and re-create, the default process group of one engine.

A notebook outlives its process groups: an interrupted cell or a rank that skipped a collective
leaves the group unusable, and the pool repairs it by calling `init_distributed` again on every
rank. So this module is built for being called twice: it tears down whatever group exists first,
and it rendezvous through an explicit TCPStore (rank 0 hosts it) rather than environment
variables, so a new port per re-creation is just an argument.

A local pool (a loopback rendezvous address: every rank on this host) listens on loopback only.
torch's TCPStore server binds every interface whatever address it is given, and gloo binds the
address this host's name resolves to, so on a shared machine both would accept connections from
the network; rank 0 therefore hands the store a socket it bound to loopback itself, and gloo is
pointed at the loopback interface (``GLOO_SOCKET_IFNAME``, read each time torch creates a gloo
group, subgroups included). Multi-host pools bind as torch does: other hosts must reach them.
"""

from __future__ import annotations

import errno
import gc
import ipaddress
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kernels_runtime.comm.accelerator import Accelerator

# what a rendezvous store says when another process took its port between find_free_port and
# the bind: the caller picks another port and tries again
PORT_TAKEN = ("address already in use", "eaddrinuse")

# torch reads GLOO_IFNAME when it creates a gloo group. A value the user set is their explicit
# choice and is left alone; the one this module sets is recorded beside it (in the environment,
# so processes started from this one, which inherit both, still tell the two apart)
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
_GLOO_IFNAME_OURS = "KERNELS_RUNTIME_GLOO_SOCKET_IFNAME"


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
    local = is_loopback(master_addr)
    _bind_gloo_to_loopback(local)
    if store is None:
        listen_fd = _loopback_listener(master_addr, master_port) if local and rank == 0 else None
        store = dist.TCPStore(master_addr, master_port, world_size, rank == 0, timeout=timeout,
                              master_listen_fd=listen_fd)
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


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` (an address or a host name) reaches this host only: every address it
    resolves to is a loopback one (127.0.0.0/8, ::1). A name that does not resolve is not."""
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(
        ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos
    )


def _loopback_listener(addr: str, port: int) -> int:
    """A socket listening on ``addr:port`` (a loopback address), as a file descriptor that the
    TCPStore server takes over (``master_listen_fd``; the store closes it).

    A port taken meanwhile raises RuntimeError saying "address already in use", as torch's own
    bind does, so the callers' retry on another port still applies."""
    infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    family, _, _, _, sockaddr = min(infos, key=lambda i: i[0] != socket.AF_INET)  # IPv4 first
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise RuntimeError(f"rendezvous port {addr}:{port}: address already in use") from err
        raise
    return sock.detach()


def _loopback_interface() -> str:
    """The name of the interface holding 127.0.0.1 (``lo`` on Linux, ``lo0`` on macOS)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs):
            return name
    return "lo"


def _bind_gloo_to_loopback(local: bool) -> None:
    """Point gloo at the loopback interface for a local pool; for a multi-host one put back
    what the environment held before (a pool re-created on other hosts must not keep lo)."""
    env = os.environ
    if GLOO_IFNAME in env and env[GLOO_IFNAME] != env.get(_GLOO_IFNAME_OURS):
        return  # the user's
    if local:
        env[GLOO_IFNAME] = env[_GLOO_IFNAME_OURS] = _loopback_interface()
    else:
        env.pop(GLOO_IFNAME, None)
        env.pop(_GLOO_IFNAME_OURS, None)


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

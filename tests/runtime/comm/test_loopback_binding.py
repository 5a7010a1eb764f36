"""A local pool listens on loopback only.

What is protected: on a pool whose ranks all run on this host (a loopback rendezvous), no rank
process accepts connections from the network: the TCPStore rank 0 serves and every gloo group
(the default one and subgroups made later) listen on 127.0.0.1/::1. torch alone binds the store
on every interface. And the choice stays the user's: an explicit ``GLOO_SOCKET_IFNAME`` is kept,
and a multi-host rendezvous drops the loopback setting a local one made.
"""

from __future__ import annotations

import ipaddress
import os
import socket

import psutil
import pytest
import torch
import torch.distributed as dist

from kernels_runtime.comm import process_group as pg


def _listening(rank: int, world_size: int) -> list[str]:
    """This rank's listening addresses, after a subgroup and a collective on each group."""
    sub = dist.new_group(list(range(world_size)))
    for group in (None, sub):
        x = torch.ones(2)
        dist.all_reduce(x, group=group)
        assert x.tolist() == [world_size] * 2
    dist.destroy_process_group(sub)
    conns = psutil.Process().net_connections(kind="inet")
    return [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN]


def test_local_pool_listens_on_loopback_only(ranks) -> None:
    per_rank = ranks(2).run(_listening)
    assert per_rank[0], "rank 0 serves the rendezvous store, so it must listen somewhere"
    for rank, addrs in enumerate(per_rank):
        outside = [a for a in addrs if not ipaddress.ip_address(a.split("%")[0]).is_loopback]
        assert not outside, f"rank {rank} listens beyond loopback on {outside} (all: {addrs})"


@pytest.mark.parametrize(("addr", "local"), [
    ("127.0.0.1", True), ("::1", True), ("localhost", True), ("127.0.1.1", True),
    ("10.1.2.3", False), ("192.0.2.7", False), ("no-such-host.invalid", False),
])
def test_is_loopback(addr: str, local: bool) -> None:
    assert pg.is_loopback(addr) is local


def test_gloo_interface_follows_the_rendezvous(monkeypatch) -> None:
    monkeypatch.delenv(pg.GLOO_IFNAME, raising=False)
    monkeypatch.delenv(pg._GLOO_IFNAME_OURS, raising=False)
    pg._bind_gloo_to_loopback(True)
    lo = pg._loopback_interface()
    assert lo in psutil.net_if_addrs()
    assert os.environ[pg.GLOO_IFNAME] == lo
    pg._bind_gloo_to_loopback(False)  # re-created on several hosts: torch's default again
    assert pg.GLOO_IFNAME not in os.environ
    monkeypatch.setenv(pg.GLOO_IFNAME, "eth7")  # the user's explicit choice wins either way
    pg._bind_gloo_to_loopback(True)
    pg._bind_gloo_to_loopback(False)
    assert os.environ[pg.GLOO_IFNAME] == "eth7"


def test_taken_port_reads_as_taken() -> None:
    """The callers retry on another port when the message says the address is in use."""
    fd = pg._loopback_listener("127.0.0.1", 0)
    with socket.socket(fileno=fd) as held:
        port = held.getsockname()[1]
        with pytest.raises(RuntimeError) as err:
            pg._loopback_listener("127.0.0.1", port)
    assert any(m in str(err.value).lower() for m in pg.PORT_TAKEN)

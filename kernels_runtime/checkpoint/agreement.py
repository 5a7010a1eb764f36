"""Collective steps of save and load that must end the same way on every rank.

A plain barrier hangs the healthy ranks until the group's timeout when one rank fails (disk
full, a damaged file only that rank reads). Here each phase ends in an all-reduce of a failure
flag instead: it synchronises like a barrier and tells every rank whether some rank failed, so
they all raise together and none is left waiting inside a collective.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import torch
import torch.distributed as dist

from kernels_runtime.checkpoint.format import CheckpointError
from kernels_runtime.comm import Collectives


def attempt(action: Callable[[], object]) -> BaseException | None:
    """Run ``action``; return what it raised instead of raising it."""
    try:
        action()
    except Exception as err:  # re-raised by ``agree`` after every rank has voted
        return err
    return None


def agree(comm: Collectives, device: torch.device, error: BaseException | None, what: str) -> None:
    """Barrier over all ranks that also fails on all of them when ``error`` is set on any."""
    vote = torch.tensor([dist.get_rank() + 1 if error else 0], dtype=torch.int64, device=device)
    comm.all_reduce(vote, op=dist.ReduceOp.MAX)
    if error is not None:
        raise error
    failed = int(vote.item())
    if failed:
        raise CheckpointError(f"{what} failed on rank {failed - 1} (see that rank's error); "
                              "this rank stopped too")


def shared_token(comm: Collectives, device: torch.device) -> str:
    """A random hex token chosen by rank 0 and known to every rank (names a temporary folder)."""
    value = torch.tensor([secrets.randbits(62) if dist.get_rank() == 0 else 0],
                         dtype=torch.int64, device=device)
    comm.broadcast(value, src=0)
    return f"{int(value.item()):016x}"

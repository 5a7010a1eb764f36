"""The communication of expert parallelism: a variable-split all-to-all that autograd can run.

Dropless routing (no capacity factor, Gale et al. 2022 "MegaBlocks") means a rank sends each
other rank as many token rows as its router picked for that rank's experts, a number known only
after routing. So every dispatch is two exchanges: first the per-expert row counts (one small
all-to-all of E integers, ``exchange_counts``), from which each rank knows how many rows it will
receive from whom; then the rows themselves (``all_to_all_v``), with per-rank split sizes.

The combine that brings expert outputs back is the same exchange with the splits swapped, and so
is the backward of either: the gradient of row r sent to rank j comes back from rank j. Every rank
takes part in every exchange even when it sends or receives no row (a split of 0), so a batch in
which one rank's experts get no token does not leave another rank waiting: there is no
data-dependent skip of a collective anywhere on this path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from kernels_runtime.comm.collectives import Collectives
from kernels_runtime.comm.groups import Group


def exchange_counts(counts: Tensor, comm: Collectives, group: Group) -> Tensor:
    """Row counts per expert, sent (E,) -> received (ep, E/ep).

    ``counts[e]`` is how many rows this rank sends to expert e; experts are laid out in rank
    order (rank r holds experts [r*E/ep, (r+1)*E/ep)). Row i of the result holds the counts rank
    i sends to each of this rank's local experts.
    """
    ep = dist.get_world_size(group)
    if counts.numel() % ep:
        raise ValueError(f"{counts.numel()} experts do not divide over ep={ep} ranks")
    sent = counts.to(torch.int64).contiguous()  # (E,)
    received = torch.empty_like(sent)  # (E,): ep chunks of E/ep
    if ep > 1:
        comm.all_to_all(received, sent, group=group)
    else:
        received.copy_(sent)
    return received.view(ep, -1)  # (ep, E/ep)


class _AllToAllV(torch.autograd.Function):
    """Rows of ``x`` split by ``send`` go to the group's ranks; ``recv`` rows come back from each.

    Backward: the gradient travels the opposite way, the split lists swapped."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Collectives, group: Group, send: list[int],
                recv: list[int]) -> Tensor:
        ctx.comm, ctx.group, ctx.send, ctx.recv = comm, group, send, recv
        return _exchange(x, comm, group, send, recv)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        return _exchange(grad, ctx.comm, ctx.group, ctx.recv, ctx.send), None, None, None, None


def _exchange(x: Tensor, comm: Collectives, group: Group, send: list[int],
              recv: list[int]) -> Tensor:
    if x.shape[0] != sum(send):
        raise ValueError(f"all-to-all of {x.shape[0]} rows with send splits {send} "
                         f"(sum {sum(send)}): the splits must add up to the rows")
    x = x.contiguous()  # (sum(send), ...)
    out = x.new_empty((sum(recv), *x.shape[1:]))  # (sum(recv), ...)
    if dist.get_world_size(group) == 1:
        return out.copy_(x)
    return comm.all_to_all(out, x, group=group, output_split_sizes=list(recv),
                           input_split_sizes=list(send))


def all_to_all_v(x: Tensor, comm: Collectives, group: Group, send: list[int],
                 recv: list[int]) -> Tensor:
    """(sum(send), ...) -> (sum(recv), ...): ``send[j]`` rows to group rank j, ``recv[j]`` rows
    from it, in rank order. Differentiable; its backward is the reverse exchange."""
    return _AllToAllV.apply(x, comm, group, list(send), list(recv))

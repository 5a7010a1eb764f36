"""Collectives that autograd can differentiate through, each with its backward beside it.

Tensor and sequence parallelism put collectives inside the model's forward, so their backward
must be the conjugate collective. The pairs (Megatron-LM's f and g, Shoeybi et al. 2019, and
their sequence-parallel counterparts, Korthikanti et al. 2022):

| function                     | forward                          | backward                      |
|------------------------------|----------------------------------|-------------------------------|
| ``copy_to_group``      (f)   | identity (input replicated)      | all-reduce (sum)              |
| ``reduce_from_group``  (g)   | all-reduce (sum)                 | identity                      |
| ``gather_from_group``        | all-gather along ``dim``         | split, or reduce-scatter      |
| ``scatter_to_group``         | keep this rank's chunk of ``dim``| all-gather along ``dim``      |
| ``reduce_scatter_to_group``  | reduce-scatter along ``dim``     | all-gather along ``dim``      |
| ``all_to_all``               | scatter ``scatter_dim``, gather  | the same with the dims        |
|                              | ``gather_dim`` (Ulysses)         | swapped                       |

``gather_from_group``'s backward depends on what follows it: when every rank computes the same
thing from the gathered tensor (its gradient is replicated) the backward keeps this rank's chunk
(``backward="split"``); when each rank computes a different part (the input of a column-parallel
layer under sequence parallelism) the partial gradients are summed and scattered
(``backward="reduce_scatter"``). Every call goes through the instrumented ``Collectives``, so the
telemetry counts it per axis. Chunks along ``dim`` are equal: sizes must divide by the group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from kernels_runtime.comm.collectives import Collectives
from kernels_runtime.comm.groups import Group


def _size(group: Group) -> int:
    return dist.get_world_size(group)


def _all_reduce(x: Tensor, comm: Collectives, group: Group) -> Tensor:
    return comm.all_reduce(x.contiguous().clone(), group=group)


def _all_gather(x: Tensor, comm: Collectives, group: Group, dim: int) -> Tensor:
    """(.., n, ..) on each rank -> (.., P*n, ..), chunks in rank order."""
    world = _size(group)
    front = x.movedim(dim, 0).contiguous()  # (n, ...)
    out = front.new_empty((world * front.shape[0], *front.shape[1:]))  # (P*n, ...)
    comm.all_gather(out, front, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: Tensor, comm: Collectives, group: Group, dim: int) -> Tensor:
    """(.., P*n, ..) partial sums -> (.., n, ..) this rank's chunk of the sum."""
    world = _size(group)
    front = x.movedim(dim, 0).contiguous()  # (P*n, ...)
    if front.shape[0] % world:
        raise ValueError(f"reduce-scatter along dim {dim}: size {front.shape[0]} does not divide "
                         f"by the group's {world} ranks")
    out = front.new_empty((front.shape[0] // world, *front.shape[1:]))  # (n, ...)
    comm.reduce_scatter(out, front, group=group)
    return out.movedim(0, dim)


def _split(x: Tensor, group: Group, dim: int) -> Tensor:
    world, rank = _size(group), dist.get_rank(group)
    if x.shape[dim] % world:
        raise ValueError(f"splitting dim {dim} of size {x.shape[dim]} over {world} ranks: the "
                         "size must divide by the group")
    return x.chunk(world, dim)[rank].contiguous()


def _all_to_all(x: Tensor, comm: Collectives, group: Group, scatter_dim: int,
                gather_dim: int) -> Tensor:
    world = _size(group)
    if x.shape[scatter_dim] % world:
        raise ValueError(f"all-to-all scatters dim {scatter_dim} of size {x.shape[scatter_dim]}"
                         f" over {world} ranks: the size must divide by the group")
    chunks = torch.stack(x.chunk(world, scatter_dim), 0).contiguous()  # (P, ..chunk..)
    received = torch.empty_like(chunks)  # received[j]: rank j's chunk for this rank
    comm.all_to_all(received, chunks, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Collectives, group: Group) -> Tensor:
        ctx.comm, ctx.group = comm, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        return _all_reduce(grad, ctx.comm, ctx.group), None, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Collectives, group: Group) -> Tensor:
        return _all_reduce(x, comm, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        return grad, None, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Collectives, group: Group, dim: int,
                backward: str) -> Tensor:
        ctx.comm, ctx.group, ctx.dim, ctx.mode = comm, group, dim, backward
        return _all_gather(x, comm, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        if ctx.mode == "split":
            return _split(grad, ctx.group, ctx.dim), None, None, None, None
        return _reduce_scatter(grad, ctx.comm, ctx.group, ctx.dim), None, None, None, None


class _ScatterToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Collectives, group: Group, dim: int) -> Tensor:
        ctx.comm, ctx.group, ctx.dim = comm, group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        return _all_gather(grad, ctx.comm, ctx.group, ctx.dim), None, None, None


class _ReduceScatterToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Collectives, group: Group, dim: int) -> Tensor:
        ctx.comm, ctx.group, ctx.dim = comm, group, dim
        return _reduce_scatter(x, comm, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        return _all_gather(grad, ctx.comm, ctx.group, ctx.dim), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Collectives, group: Group, scatter_dim: int,
                gather_dim: int) -> Tensor:
        ctx.comm, ctx.group, ctx.dims = comm, group, (scatter_dim, gather_dim)
        return _all_to_all(x, comm, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        scatter_dim, gather_dim = ctx.dims
        return (_all_to_all(grad, ctx.comm, ctx.group, gather_dim, scatter_dim),
                None, None, None, None)


def copy_to_group(x: Tensor, comm: Collectives, group: Group) -> Tensor:
    """Megatron's f: enter a tensor-parallel region with a replicated input."""
    return _CopyToGroup.apply(x, comm, group) if _size(group) > 1 else x


def reduce_from_group(x: Tensor, comm: Collectives, group: Group) -> Tensor:
    """Megatron's g: leave a tensor-parallel region by summing the partial outputs."""
    return _ReduceFromGroup.apply(x, comm, group) if _size(group) > 1 else x


def gather_from_group(x: Tensor, comm: Collectives, group: Group, dim: int,
                      backward: str = "split") -> Tensor:
    """All-gather along ``dim``; ``backward`` is "split" or "reduce_scatter" (module doc)."""
    if backward not in ("split", "reduce_scatter"):
        raise ValueError(f"backward={backward!r}: choose 'split' or 'reduce_scatter'")
    return _GatherFromGroup.apply(x, comm, group, dim, backward) if _size(group) > 1 else x


def scatter_to_group(x: Tensor, comm: Collectives, group: Group, dim: int) -> Tensor:
    """Keep this rank's chunk of ``dim`` (a replicated input entering a sharded region)."""
    return _ScatterToGroup.apply(x, comm, group, dim) if _size(group) > 1 else x


def reduce_scatter_to_group(x: Tensor, comm: Collectives, group: Group, dim: int) -> Tensor:
    """Sum partial tensors and keep this rank's chunk of ``dim`` (leaving a row-parallel
    layer under sequence parallelism)."""
    return _ReduceScatterToGroup.apply(x, comm, group, dim) if _size(group) > 1 else x


def all_to_all(x: Tensor, comm: Collectives, group: Group, scatter_dim: int,
               gather_dim: int) -> Tensor:
    """Split ``scatter_dim`` over the group and concatenate what arrives along ``gather_dim``
    (Ulysses: sequence-sharded -> head-sharded before attention, and back after)."""
    return _AllToAll.apply(x, comm, group, scatter_dim, gather_dim) if _size(group) > 1 else x

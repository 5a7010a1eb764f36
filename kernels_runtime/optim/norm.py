"""Reductions of the optimizer step that span every axis: the global gradient norm and the
fp16 overflow vote.

The norm must count every gradient element exactly once, whatever holds it: shards over dp
(ZeRO), tp (tensor-parallel weights) or pp (each stage's own parameters), and replicas of the
rest (a LayerNorm weight is replicated over tp; under DDP every gradient is replicated over dp).
So each rank sums the squares of its shards over the axes they are sharded along, a replicated
shard only on the rank whose coordinate is 0 along the reduction axes it is replicated over,
and one all-reduce over the smallest group spanning every sharded axis adds them up. With
nothing sharded (DDP) there is no collective at all.

The overflow vote spans every rank that steps: if any rank's gradients hold inf or nan, all of
them skip the step, or replicas would diverge.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.plan import AXES
from kernels_runtime.optim.sync import GradShard


def _reduction_axes(ctx: ParallelContext, group: dist.ProcessGroup | None,
                    live: set[str]) -> set[str]:
    if group is None:
        return set()
    if group is dist.group.WORLD:
        return {a for a in AXES if ctx.size(a) > 1}
    return live


def global_grad_norm_tensor(shards: list[GradShard], ctx: ParallelContext) -> torch.Tensor:
    """The global norm as a 0-dim fp32 tensor on the rank's device: no host synchronization,
    so clipping can scale gradients by it while the device is still computing it."""
    live = {a for s in shards for a in s.sharded if ctx.size(a) > 1}
    group = ctx.span_group(live)
    over = _reduction_axes(ctx, group, live)
    sq = torch.zeros((), dtype=torch.float32, device=ctx.device)
    for s in shards:
        if s.primary and all(ctx.coord(a) == 0 for a in over - s.sharded):
            sq += s.tensor.float().pow(2).sum()
    if group is not None:
        ctx.comm.all_reduce(sq, group=group)
    return sq.sqrt()


def global_grad_norm(shards: list[GradShard], ctx: ParallelContext) -> float:
    """L2 norm of the whole model's gradient (see the module docstring)."""
    return float(global_grad_norm_tensor(shards, ctx).item())


def any_rank_overflowed(found: torch.Tensor, ctx: ParallelContext) -> bool:
    """Whether ``found`` (1.0 where this rank saw inf/nan) is set on any rank that steps."""
    group = ctx.span_group(AXES)
    if group is not None:
        ctx.comm.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return found.item() > 0

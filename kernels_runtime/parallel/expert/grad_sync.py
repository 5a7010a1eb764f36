"""Gradients under expert parallelism: two data-parallel syncs, one per kind of parameter.

A rank of an ep group holds every non-expert parameter (attention, norms, routers, shared
experts) and E/ep of each block's experts. The non-expert parameters are replicas over all dp
ranks, each seeing its own tokens, so their gradients are averaged over dp (which holds the ep
ranks) as without experts. An expert's gradient already sums the tokens every rank of its ep
group sent it (the all-to-all brought them), so it is reduced over the expert-data-parallel
group only: the dp/ep ranks holding the same experts (Megatron-Core's expert-data-parallel
group; DeepSpeed-MoE's ``expert_data_parallel_group``). Averaging over those dp/ep ranks and
scaling by 1/ep (``set_expert_grad_scale``: in the experts' backward) gives the same mean over
dp as the other parameters get.

Rather than teach the flat buckets two groups, ``ExpertGradSync`` runs the project's ZeRO 0-2
strategy (``ZeroGradSync``) twice: once over the non-expert parameters on the plan's context,
once over the expert parameters on an expert-data view of it (``expert_data_context``: the
edp group as its dp axis). Each shards its own parameters over its own group, so ZeRO 1/2 shard
the experts within their expert-data group. One inner optimizer steps the masters of both,
and a checkpoint reads both syncs' pieces, each placed through its own view of the expert
layouts (``layouts.py``).

Offload does the same with its chunk sync (``memory/expert_chunks.py``): what the two pairs
share, building the dense and the expert sync and handing each call to both, is
``ExpertSyncPair``, so the split of the parameters, the optimizer and the layouts is written
once for every strategy that runs twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.shards import ParamLayout
from kernels_runtime.optim import (
    GradShard,
    GradSync,
    StatePiece,
    optimizer_state_tensors,
    rebuild_optimizer,
    tensor_bytes,
)
from kernels_runtime.parallel.data.zero import ZeroGradSync
from kernels_runtime.parallel.expert.layouts import on_expert_data
from kernels_runtime.parallel.expert.moe_layer import LocalExperts, is_expert_parameter


def expert_data_context(ctx: ParallelContext) -> ParallelContext:
    """``ctx`` with the expert-data-parallel group as its dp axis (dp/ep ranks): what a data
    strategy sees when it reduces and shards expert parameters."""
    ep = ctx.plan.ep
    group = ctx.group("edp")
    plan = replace(ctx.plan, dp=ctx.dp_size // ep, ep=1)
    coords = dict(ctx.coords, dp=dist.get_group_rank(group, dist.get_rank()))
    return ParallelContext(plan, ctx.mesh, ctx.comm, ctx.device, coords,
                           dict(ctx.groups, dp=group), ctx.topology, ctx.pp_prev, ctx.pp_next)


class _Subset(nn.Module):
    """The parameters of ``model`` that ``keep`` selects, under their names in ``model``: what
    one of the two syncs is built over, so each casts, counts and buckets only its own."""

    def __init__(self, model: nn.Module, keep: Callable[[nn.Parameter], bool]) -> None:
        super().__init__()
        self.__dict__["whole"] = model  # not a submodule: its parameters are not all ours
        self.keep = keep

    def named_parameters(self, *args, **kwargs) -> Iterator[tuple[str, nn.Parameter]]:
        return ((n, p) for n, p in self.whole.named_parameters() if self.keep(p))

    def parameters(self, *args, **kwargs) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def to(self, *args, **kwargs) -> _Subset:
        self.whole.to(*args, **kwargs)
        return self


class ParamView(_Subset):
    """A ``_Subset`` that also shows ``model``'s modules as its own: what the offload chunks
    are built over, since they find their units (blocks, embeddings, head) by walking the
    module tree and keep only the parameters the view selects."""

    def named_modules(self, *args, **kwargs) -> Iterator[tuple[str, nn.Module]]:
        return self.whole.named_modules(*args, **kwargs)

    def modules(self) -> Iterator[nn.Module]:
        return self.whole.modules()


def set_expert_grad_scale(model: nn.Module, ep: int) -> None:
    """Every local expert's gradient times 1/ep: the expert-data average then equals the mean
    over dp (each expert gradient already sums the tokens of its ep group's ranks)."""
    for module in model.modules():
        if isinstance(module, LocalExperts):
            module.grad_scale = 1.0 / ep


def split_optimizer(optimizer: torch.optim.Optimizer, replaced: dict[int, nn.Parameter]
                    ) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer | None]:
    """Two optimizers of the user's class and per-group settings, over the non-expert and the
    expert parameters of each group (the model's current ones: ``replaced`` maps the swapped
    expert tensors). None for the experts when none is trainable (frozen experts)."""
    dense, experts = [], []
    for group in optimizer.param_groups:
        params = [replaced.get(id(p), p) for p in group["params"]]
        dense.append([p for p in params if not is_expert_parameter(p)])
        experts.append([p for p in params if is_expert_parameter(p)])
    if not any(p.requires_grad for g in experts for p in g):
        return rebuild_optimizer(optimizer, dense), None
    return rebuild_optimizer(optimizer, dense), rebuild_optimizer(optimizer, experts)


class ExpertSyncPair(GradSync):
    """One data strategy run twice: over the non-expert parameters on the plan's context
    (``self.dense``) and over the expert ones on the expert-data view of it (``self.experts``;
    None when no expert is trainable), with the layouts as that view sees them. A subclass
    says how one sync is built (``build``) and what each parameter view is (``view``); the
    calls both syncs answer alike are handed to each in turn, the dense one first."""

    view: type[_Subset] = _Subset  # what each of the two syncs is built over
    dense: Any  # the non-expert parameters' sync
    experts: Any  # the expert parameters' sync, or None
    expert_names: set[str]  # the expert parameters, by name

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 ctx: ParallelContext, layouts: dict[str, ParamLayout],
                 replaced: dict[int, nn.Parameter] | None = None) -> None:
        self.ctx, self.expert_ctx = ctx, expert_data_context(ctx)
        dense_opt, expert_opt = split_optimizer(optimizer, replaced or {})
        experts = self.view(model, is_expert_parameter)
        self.expert_names = {n for n, _ in experts.named_parameters()}
        self.dense = self.build(self.view(model, lambda p: not is_expert_parameter(p)),
                                dense_opt, ctx, layouts, expert=False)
        self.experts = None if expert_opt is None else self.build(
            experts, expert_opt, self.expert_ctx, on_expert_data(layouts, self.expert_names),
            expert=True)

    def build(self, params: nn.Module, optimizer: torch.optim.Optimizer,
              ctx: ParallelContext, layouts: dict[str, ParamLayout], expert: bool) -> Any:
        """One of the two syncs, over ``params`` (the dense one is built first)."""
        raise NotImplementedError(f"{type(self).__name__} must say how a sync is built")

    def syncs(self) -> list[Any]:
        return [self.dense] if self.experts is None else [self.dense, self.experts]

    def master_groups(self) -> list[list[torch.Tensor]]:
        if self.experts is None:
            return self.dense.master_groups()
        return [d + e for d, e in zip(self.dense.master_groups(), self.experts.master_groups())]

    def prepare_backward(self, sync: bool) -> None:
        for s in self.syncs():
            s.prepare_backward(sync)

    def finish(self) -> None:
        for s in self.syncs():
            s.finish()

    def publish(self) -> None:
        for s in self.syncs():
            s.publish()

    def zero_grads(self) -> None:
        for s in self.syncs():
            s.zero_grads()

    def pieces(self, saving: bool, optimizer: torch.optim.Optimizer | None) -> list[StatePiece]:
        """Both syncs' pieces; their states are the one inner optimizer's, read by master."""
        return [piece for s in self.syncs() for piece in s.pieces(saving, optimizer)]


class ExpertGradSync(ExpertSyncPair):
    """ZeRO 0-2 over dp for non-expert parameters and over expert-dp for expert ones."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 ctx: ParallelContext, layouts: dict[str, ParamLayout], *, zero_stage: int,
                 precision: str, bucket_mb: float = 8.0,
                 replaced: dict[int, nn.Parameter] | None = None) -> None:
        self.stage = zero_stage
        self.settings = dict(zero_stage=zero_stage, precision=precision, bucket_mb=bucket_mb)
        super().__init__(model, optimizer, ctx, layouts, replaced)

    def build(self, params: nn.Module, optimizer: torch.optim.Optimizer,
              ctx: ParallelContext, layouts: dict[str, ParamLayout],
              expert: bool) -> ZeroGradSync:
        return ZeroGradSync(params, optimizer, ctx, layouts, **self.settings)

    def reduce_now(self) -> None:
        for s in self.syncs():
            s.reduce_now()

    def master_grads(self) -> list[GradShard]:
        """The expert shards differ across the ep ranks too, so they count as sharded over dp
        for the global norm; under zero 0 their expert-dp replicas count once (place 0)."""
        shards = self.dense.master_grads()
        if self.experts is not None:
            first = self.expert_ctx.dp_rank == 0 or self.stage > 0
            shards += [GradShard(s.tensor, s.sharded | {"dp"}, s.primary and first)
                       for s in self.experts.master_grads()]
        return shards

    def memory_breakdown(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Both syncs' bytes, the optimizer states (which each of them reads from the one
        inner optimizer) counted once."""
        parts = [s.memory_breakdown(optimizer) for s in self.syncs()]
        out = {k: sum(p[k] for p in parts) for k in parts[0]}
        out["optimizer"] -= (len(parts) - 1) * tensor_bytes(optimizer_state_tensors(optimizer))
        return out

"""The data-parallel step of an expert-parallel model: replicas made equal, gradients synced.

``parallelize`` runs this in the data applier's place; without experts (ep=1) it is the data
applier itself. With ep > 1 two things differ from it. Replicas are made equal per kind of
parameter: non-expert parameters (and buffers) from the first rank of each dp group, expert
slices from the first rank of each expert-data group, since the ranks of an ep group hold
different experts under the same names and shapes (a dp-wide broadcast would silently copy
rank 0's experts everywhere; a model ``to_be_loaded`` gets zeros where it is still on meta,
as the data applier gives it, for ``load_pretrained`` to fill). And training reduces each
kind over its own group (``ExpertGradSync`` under zero 0-2, ``zero3.py`` under zero 3, and
under offload the offload applier's ``ExpertChunkSync``).
"""

from __future__ import annotations

from torch import nn

from kernels_runtime.deferred_params import allocate, move_real, to_be_loaded
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.parallel.data import applier as data
from kernels_runtime.parallel.expert.grad_sync import ExpertGradSync, set_expert_grad_scale
from kernels_runtime.parallel.expert.moe_layer import is_expert_parameter
from kernels_runtime.parallel.expert.zero3 import apply_zero3
from kernels_runtime.parallel.state import ParallelState


def sync_replicas(model: nn.Module, ctx: ParallelContext) -> None:
    """Non-expert tensors equal over dp and expert slices over expert-dp, each from its group's
    first rank (the two groups in one fixed order on every rank)."""
    experts = [p for p in model.parameters() if is_expert_parameter(p)]
    seen = {id(p) for p in experts}
    dense = [t for t in [*model.parameters(), *model.buffers()] if id(t) not in seen]
    data.broadcast_from_first(dense, ctx, ctx.dp_group, ctx.dp_size)
    data.broadcast_from_first(experts, ctx, ctx.group("edp"), ctx.dp_size // ctx.plan.ep)


def apply(model: nn.Module, state: ParallelState) -> nn.Module:
    """The data applier's work, expert-aware (zero 0-3; under offload the offload applier
    builds the step, ``memory/expert_chunks.py``)."""
    ctx, plan = state.ctx, state.ctx.plan
    if plan.ep == 1:
        return data.apply(model, state)
    move_real(model, ctx.device)
    sync_replicas(model, ctx)  # meta parameters are skipped: a loader fills every rank
    set_expert_grad_scale(model, plan.ep)
    offloading = plan.offload != "none"
    if to_be_loaded(model) and not offloading and plan.zero_stage != 3:
        allocate(model.parameters(), ctx.device)  # zeros, filled by checkpoint.pretrained
    if offloading:
        pass  # the offload applier lays both kinds out in chunks (memory/expert_chunks.py)
    elif plan.zero_stage == 3:
        apply_zero3(model, state)
    else:
        # without an optimizer the expert layouts (box along the expert dim, replicas over
        # expert-dp) say it all; with one, each kind is synced over its own group
        data.replicated_state(model, state, ctx, ExpertGradSync)
    data.cast_inputs(model, plan)
    state.applied.append("data")
    return model

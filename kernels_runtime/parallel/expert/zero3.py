"""ZeRO-3 under expert parallelism: each block's local experts are their own FSDP2 unit, sharded
over the expert-data-parallel group; everything else is sharded over dp as without experts.

As torchtitan does for its MoE models, the experts module of every swapped block is
``fully_shard``-ed first on a mesh of the expert-data group (the dp/ep ranks holding the same
experts), then the data applier's ZeRO-3 (``data/fsdp.py``) shards the blocks and the root over
dp, leaving the already sharded experts to their own unit. FSDP2 averages a unit's gradient
over its mesh (expert-dp); the experts' backward has already scaled it by 1/ep
(``set_expert_grad_scale``), so it ends as the same mean over dp as the other parameters'.
(FSDP2's own ``set_gradient_divide_factor`` would do it, but needs a premultiplied-sum
reduction gloo does not have.)

No hang when an expert gets no token: the local experts run every step, on zero rows if none
came (``LocalExperts.forward``), and as one unit per block, so every rank all-gathers and
reduce-scatters every expert unit in the same order whatever the routing did.

Checkpoints: FSDP2 splits each slice's expert-data replicas into distinct shards, so the
expert layouts lose their replicas here (``layouts.under_fsdp``) and FSDP's own pieces place
every shard through them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.parallel.data.fsdp import FsdpGradSync, FsdpState, shard_model
from kernels_runtime.parallel.data.fsdp_comms import record_fsdp_comms
from kernels_runtime.parallel.expert.layouts import under_fsdp
from kernels_runtime.parallel.expert.moe_layer import (
    EXPERT_ATTR,
    LocalExperts,
    is_expert_parameter,
)
from kernels_runtime.parallel.state import ParallelState
from kernels_runtime.precision import compute_dtype


def shard_experts(model: nn.Module, ctx: ParallelContext, precision: str,
                  replaced: dict[int, nn.Parameter]) -> None:
    """``fully_shard`` every ``LocalExperts`` over the expert-data group; the new (DTensor)
    parameters replace the old ones in ``replaced``, which the user's optimizer is read
    through."""
    mesh = DeviceMesh.from_group(ctx.group("edp"), ctx.device.type)
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype(precision),
                                  reduce_dtype=torch.float32)
    units = [m for m in model.modules() if isinstance(m, LocalExperts)]
    for unit in units:
        before = dict(unit.named_parameters())
        fully_shard(unit, mesh=mesh, mp_policy=policy)
        after = dict(unit.named_parameters())
        new = {id(before[n]): after[n] for n in before}
        for param in after.values():
            setattr(param, EXPERT_ATTR, True)
        for key, value in list(replaced.items()):
            replaced[key] = new.get(id(value), value)
    record_fsdp_comms(units, ctx.comm)


def apply_zero3(model: nn.Module, state: ParallelState) -> None:
    """The zero=3 data step of an expert-parallel model (replicas already made equal)."""
    ctx, plan = state.ctx, state.ctx.plan
    shard_experts(model, ctx, plan.precision, state.replaced_params)
    names = {n for n, p in model.named_parameters() if is_expert_parameter(p)}
    layouts = under_fsdp(state.layouts, names)
    if state.optimizer is None:
        shard_model(model, state.blocks, ctx, plan.precision)
        state.model_state = FsdpState(model, ctx, layouts)
    else:
        state.grad_sync = FsdpGradSync(model, state.optimizer, ctx, layouts,
                                       blocks=state.blocks, precision=plan.precision,
                                       replaced=state.replaced_params)
        state.model_state = state.grad_sync

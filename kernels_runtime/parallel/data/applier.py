"""The data-parallel applier: replicas start equal, then ZeRO 0-2 on flat buckets or ZeRO-3 on
FSDP2, over whatever layout the earlier appliers left.

With an optimizer (``parallelize``) it builds the strategy's ``GradSync``, which is also the
model's state layout; without one (``parallelize_model``: evaluation, inference) parameters are
only made equal across replicas and cast to the compute dtype (zero 0-2), or sharded at rest
(zero 3). An offloading plan's training state is laid out by the offload applier instead
(chunks on device, host or disk: ``kernels_runtime.memory``); replicas are made equal here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kernels_runtime.deferred_params import allocate, has_deferred, move_real, to_be_loaded
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.plan import Plan
from kernels_runtime.optim.sync import GradSync
from kernels_runtime.parallel.data.fsdp import FsdpGradSync, FsdpState, shard_model
from kernels_runtime.parallel.data.replicated import ReplicatedState
from kernels_runtime.parallel.data.zero import ZeroGradSync, cast_params
from kernels_runtime.parallel.state import ParallelState
from kernels_runtime.precision import compute_dtype


def check(state: ParallelState, model: nn.Module) -> str | None:
    """Every zero stage runs (``Plan.validate`` checked the rest); deferred parameters (on the
    meta device) are initialized only by the offload applier, one unit at a time, unless a
    loader fills them (``to_be_loaded``: storage for what this rank holds, see ``apply``)."""
    offloading = state.ctx.plan.offload != "none"
    if has_deferred(model) and not offloading and not to_be_loaded(model):
        return ("the model's parameters are on the meta device (built under "
                "deferred_parameters()): only an offloading plan materializes them, unit by "
                "unit (e.g. add 'zero=3 offload=auto "
                "device_mem=...'); otherwise build the model normally")
    return None


def apply(model: nn.Module, state: ParallelState) -> nn.Module:
    ctx, plan = state.ctx.fold_sp(), state.ctx.plan  # sp ranks are data replicas here
    move_real(model, ctx.device)  # deferred (meta) parameters are materialized later
    sync_module_states(model, ctx)  # meta parameters are skipped: a loader fills every rank
    offloading = plan.offload != "none"
    if to_be_loaded(model) and not offloading and plan.zero_stage != 3:
        allocate(model.parameters(), ctx.device)  # held whole under zero 0-2 (FSDP: shards)
    if offloading:
        pass  # the offload applier lays the state out in chunks (kernels_runtime.memory)
    elif plan.zero_stage == 3:
        if state.optimizer is None:
            shard_model(model, state.blocks, ctx, plan.precision)
            state.model_state = FsdpState(model, ctx, state.layouts)
        else:
            state.grad_sync = FsdpGradSync(model, state.optimizer, ctx, state.layouts,
                                           blocks=state.blocks, precision=plan.precision,
                                           replaced=state.replaced_params)
            state.model_state = state.grad_sync
    else:
        replicated_state(model, state, ctx, ZeroGradSync)
    cast_inputs(model, plan)
    state.applied.append("data")
    return model


def replicated_state(model: nn.Module, state: ParallelState, ctx: ParallelContext,
                     grad_sync: Callable[..., GradSync]) -> None:
    """Zero 0-2's state: without an optimizer, parameters cast to the compute dtype and
    described as replicas over their layouts; with one, ``grad_sync`` (``ZeroGradSync``, or the
    expert package's ``ExpertGradSync``, which syncs each kind of parameter over its own
    group) on flat buckets, which is also the model's state layout."""
    plan = state.ctx.plan
    if state.optimizer is None:
        cast_params(model, compute_dtype(plan.precision))
        state.model_state = ReplicatedState(model, ctx, state.layouts)
        return
    state.grad_sync = grad_sync(model, state.optimizer, ctx, state.layouts,
                                zero_stage=plan.zero_stage, precision=plan.precision,
                                bucket_mb=state.bucket_mb, replaced=state.replaced_params)
    state.model_state = state.grad_sync


def cast_inputs(model: nn.Module, plan: Plan) -> None:
    """Floating-point inputs cast to the compute dtype, unless FSDP2 (zero 3 without offload)
    casts them itself or the plan computes in fp32."""
    if (plan.offload != "none" or plan.zero_stage != 3) and plan.precision != "fp32":
        model.register_forward_pre_hook(input_caster(compute_dtype(plan.precision)),
                                        with_kwargs=True)


def sync_module_states(model: nn.Module, ctx: ParallelContext) -> None:
    """Broadcast parameters and buffers from the first rank of each dp group."""
    broadcast_from_first([*model.parameters(), *model.buffers()], ctx, ctx.dp_group,
                         ctx.dp_size)


def broadcast_from_first(tensors: list[torch.Tensor], ctx: ParallelContext, group: Any,
                         size: int) -> None:
    """Make ``tensors`` equal over ``group`` (``size`` ranks) from its first rank; empty, meta
    (a loader fills every rank) and single-value views are left alone."""
    if size == 1:
        return
    src = dist.get_global_rank(group, 0)
    pending = [ctx.comm.broadcast_async(t.data, src=src, group=group) for t in tensors
               if t.numel() and not t.is_meta and not _one_value(t)]
    for op in pending:
        op.wait()


def _one_value(t: torch.Tensor) -> bool:
    """An expanded view of a single value (a later pipeline stage's hollowed embedding,
    ``pipeline/stage.py``): equal on every rank, and no broadcast can write into it."""
    return t.dim() > 0 and 0 in t.stride() and t.untyped_storage().nbytes() <= t.element_size()


def input_caster(dtype: torch.dtype):
    """Cast floating-point inputs to the model's dtype (pixel values, embeddings passed in)."""

    def cast(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    return hook

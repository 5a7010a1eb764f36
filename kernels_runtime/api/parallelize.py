"""``parallelize(model, optimizer, plan)``: one call from a plain PyTorch model to a parallel one.

Model code stays unchanged. The model's policy (``kernels_runtime.policies``) says where its
transformer blocks are; the plan says how to split. Today data parallelism (DDP and ZeRO 1-3),
mixed precision and activation checkpointing are implemented; tensor, pipeline and sequence
parallelism plug in here when their packages land.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kernels_runtime.api.optimizer import BoostedOptimizer
from kernels_runtime.comm import Collectives
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.plan import Plan, PlanError
from kernels_runtime.parallel.activation_checkpoint import apply_activation_checkpointing
from kernels_runtime.parallel.data.fsdp import FsdpOptimizer
from kernels_runtime.parallel.data.zero_optimizer import ZeroOptimizer
from kernels_runtime.policies import get_policy
from kernels_runtime.precision import compute_dtype


def parallelize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: Plan | str | None = None,
    *,
    ctx: ParallelContext | None = None,
    comm: Collectives | None = None,
    policy: Any = None,
    max_grad_norm: float | None = None,
    bucket_mb: float = 8.0,
) -> tuple[nn.Module, BoostedOptimizer]:
    """Return the model (changed in place) and a ``BoostedOptimizer`` wrapping ``optimizer``.

    Collective: every rank calls it with the same plan and a model of the same architecture.
    Parameters are broadcast from the first data-parallel rank so every replica starts equal.
    Pass a fresh optimizer: it is rebuilt over the runtime's own (flat, sharded) tensors with
    the same class and per-group hyperparameters.
    """
    if ctx is None:
        ctx = ParallelContext.build(plan if plan is not None else Plan(), comm)
    elif plan is not None and Plan.parse(plan).validate(ctx.world_size) != ctx.plan:
        raise PlanError(f"plan {plan!r} differs from the context's plan {ctx.plan.to_string()!r}")
    plan = ctx.plan
    policy = policy if policy is not None else get_policy(model)
    plan.validate(ctx.world_size, policy.model_config(model))
    if plan.tp > 1 or plan.pp > 1 or plan.sp > 1:
        raise PlanError("tensor, pipeline and sequence parallelism are not available yet; "
                        "use dp and zero (e.g. \"dp=2 zero=2\")")
    blocks = policy.blocks(model)
    if plan.activation_checkpointing:
        if not blocks:
            raise PlanError(f"activation_checkpointing: the {policy.name} policy found no "
                            "transformer blocks in this model; turn it off or pass a policy")
        apply_activation_checkpointing(blocks)
    model.to(ctx.device)
    sync_module_states(model, ctx)
    if plan.zero_stage == 3:
        opt: BoostedOptimizer = FsdpOptimizer(
            model, optimizer, ctx, blocks=blocks, precision=plan.precision,
            max_grad_norm=max_grad_norm)
    else:
        opt = ZeroOptimizer(
            model, optimizer, ctx, zero_stage=plan.zero_stage, precision=plan.precision,
            max_grad_norm=max_grad_norm, bucket_mb=bucket_mb)
        if plan.precision != "fp32":
            model.register_forward_pre_hook(_input_caster(compute_dtype(plan.precision)),
                                            with_kwargs=True)
    model.parallel_context = ctx  # type: ignore[assignment]
    return model, opt


def sync_module_states(model: nn.Module, ctx: ParallelContext) -> None:
    """Broadcast parameters and buffers from the first rank of each dp group."""
    group = ctx.dp_group
    if ctx.dp_size == 1:
        return
    src = dist.get_global_rank(group, 0)
    tensors = [t for t in [*model.parameters(), *model.buffers()] if t.numel()]
    handles = [dist.broadcast(t.data, src=src, group=group, async_op=True) for t in tensors]
    for h in handles:
        h.wait()


def _input_caster(dtype: torch.dtype):
    """Cast floating-point inputs to the model's dtype (pixel values, embeddings passed in)."""

    def cast(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    return hook

"""``parallelize_model`` and ``parallelize``: one call from a plain PyTorch model to a parallel one.

Model code stays unchanged. The model's policy (``kernels_runtime.policies``) says what the
model is made of; the plan says how to split it. Each dimension is one applier, run in this
order, each building on what the earlier ones recorded in the model's ``ParallelState``:

    tensor -> sequence -> expert -> activation checkpointing -> pipeline -> data/ZeRO -> offload

Tensor parallelism first, because it changes which tensors exist (shards of each weight);
sequence parallelism then changes the activations between them; expert parallelism (ep > 1)
swaps each mixture-of-experts block for one holding its rank's experts; checkpointing wraps
the blocks as they now are; a pipeline keeps a stage's blocks; data parallelism shards what is
left over dp (under ep, expert parameters over their expert-data group instead:
``parallel/expert/data_step.py`` stands in for the data applier); offload places those shards
on device, host or disk. Every applier first says whether it can run the plan (``check``),
all before any applier changes the model, so a refused plan leaves the model untouched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kernels_runtime.comm import Collectives
from kernels_runtime.memory import offload
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.plan import Plan, PlanError
from kernels_runtime.optim import BoostedOptimizer
from kernels_runtime.parallel import activation_checkpoint
from kernels_runtime.parallel.data import applier as data
from kernels_runtime.parallel.expert import applier as expert
from kernels_runtime.parallel.expert import data_step as expert_data
from kernels_runtime.parallel.pipeline import applier as pipeline
from kernels_runtime.parallel.sequence import applier as sequence
from kernels_runtime.parallel.state import ATTRIBUTE, ParallelState, parallel_state
from kernels_runtime.parallel.tensor import applier as tensor
from kernels_runtime.policies import Policy, get_policy

Check = Callable[[ParallelState, nn.Module], "str | None"]
Apply = Callable[[nn.Module, ParallelState], nn.Module]
APPLIERS: tuple[tuple[str, Check, Apply], ...] = (
    ("tensor", tensor.check, tensor.apply),
    ("sequence", sequence.check, sequence.apply),
    ("expert", expert.check, expert.apply),
    ("activation_checkpointing", activation_checkpoint.check, activation_checkpoint.apply),
    ("pipeline", pipeline.check, pipeline.apply),
    ("data", data.check, expert_data.apply),  # data.apply itself when ep=1
    ("offload", offload.check, offload.apply),
)


def _context(plan: Plan | str | None, ctx: ParallelContext | None,
             comm: Collectives | None) -> ParallelContext:
    if ctx is None:
        return ParallelContext.build(plan if plan is not None else Plan(), comm)
    if plan is not None and Plan.parse(plan).validate(ctx.world_size) != ctx.plan:
        raise PlanError(f"plan {plan!r} differs from the context's plan {ctx.plan.to_string()!r}")
    return ctx


def parallelize_model(
    model: nn.Module,
    plan: Plan | str | None = None,
    *,
    ctx: ParallelContext | None = None,
    comm: Collectives | None = None,
    policy: Policy | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    bucket_mb: float = 8.0,
    spill_dir: str | None = None,
    verbose: bool = True,
) -> nn.Module:
    """Return ``model`` (changed in place) split under ``plan``, without an optimizer: for
    evaluation and inference (``optimizer`` is for ``parallelize``, which passes the user's).

    Collective: every rank calls it with the same plan and a model of the same architecture.
    Parameters are broadcast from the first data-parallel rank so every replica starts equal.
    The record of what was done is ``model.parallel_state`` (``.replaced``: every module
    swapped and what it became); with ``verbose`` the first rank prints that table.
    """
    previous = parallel_state(model)
    if previous is not None:
        raise PlanError(
            f"this {type(model).__name__} is already parallelized (plan "
            f"{previous.ctx.plan.to_string()!r}); parallelize a freshly built model instead, "
            "e.g. one loaded from a checkpoint with kernels_runtime.checkpoint.load_model")
    ctx = _context(plan, ctx, comm)
    policy = policy if policy is not None else get_policy(model)
    ctx.plan.validate(ctx.world_size, policy.model_config(model))
    state = ParallelState(ctx=ctx, policy=policy, optimizer=optimizer, bucket_mb=bucket_mb,
                          spill_dir=spill_dir,
                          blocks=policy.blocks(model))
    refusals = [why for _, check, _ in APPLIERS if (why := check(state, model)) is not None]
    if refusals:
        raise PlanError("; ".join(refusals))
    for _, _, apply in APPLIERS:
        model = apply(model, state)
    state.optimizer = None  # the user's optimizer is not needed any more; do not pin it
    model.__dict__[ATTRIBUTE] = state
    if verbose and state.replaced and ctx.rank == 0:
        print(replaced_table(state.replaced, ctx.plan))
    model.parallel_context = ctx  # type: ignore[assignment]
    return model


def replaced_table(replaced: list[tuple[str, str]], plan: Plan) -> str:
    """One line per kind of swapped module, block indices folded: ``h.*.attn.c_attn  Conv1D ->
    ColumnParallelLinear (column)  x12``."""
    counts: dict[tuple[str, str], int] = {}
    for path, what in replaced:
        key = (".".join("*" if part.isdigit() else part for part in path.split(".")), what)
        counts[key] = counts.get(key, 0) + 1
    width = max(len(path) for path, _ in counts)
    lines = [f"parallelize ({plan.to_string()}): {len(replaced)} modules replaced"]
    lines += [f"  {path:<{width}}  {what}  x{n}" for (path, what), n in counts.items()]
    return "\n".join(lines)


def parallelize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: Plan | str | None = None,
    *,
    ctx: ParallelContext | None = None,
    comm: Collectives | None = None,
    policy: Policy | None = None,
    max_grad_norm: float | None = None,
    bucket_mb: float = 8.0,
    spill_dir: str | None = None,
    verbose: bool = True,
) -> tuple[nn.Module, BoostedOptimizer]:
    """Return the model (changed in place) and a ``BoostedOptimizer`` wrapping ``optimizer``.

    ``parallelize_model`` with the optimizer: pass a fresh one, since it is rebuilt over the
    runtime's own (flat, sharded) tensors with the same class and per-group hyperparameters.
    ``spill_dir`` is where an offloading plan's disk tier writes (default
    ``$WORKBENCH_SPILL_DIR``, else a folder under Jupyter's runtime folder).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"parallelize takes a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}; for a model without one (evaluation, "
                        "inference) use parallelize_model(model, plan)")
    model = parallelize_model(model, plan, ctx=ctx, comm=comm, policy=policy,
                              optimizer=optimizer, bucket_mb=bucket_mb, spill_dir=spill_dir,
                              verbose=verbose)
    state = parallel_state(model)
    assert state is not None and state.grad_sync is not None
    boosted = BoostedOptimizer(optimizer, state.grad_sync, state.grad_sync.ctx,
                               state.ctx.plan.precision, max_grad_norm)
    return model, boosted

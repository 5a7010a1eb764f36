"""How the engine lays out a mixture-of-experts model over its ranks, and which plans it refuses.

A plan's ``ep`` carves groups of ep adjacent data-parallel ranks out of dp (``mesh``): in
training each rank of a group brings its own batch. An engine replica instead is one scheduler
(every rank of it computes the same tokens, as tp ranks do), so under ep the ep ranks of a
group form one replica and the dp // ep groups are the replicas (``Replicas``): prompts are
dealt over them, and the outputs gathered over the expert-data group ("edp", one rank of each
group at the same place). ``parallelize_model`` runs with ep folded away (``dense_context``:
attention, norms and the router replicated over the group as over dp), then ``split_experts``
gives each rank its experts (``moe.py``).

Transformers' MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE) take the policy training uses
(``policies.moe.MOE_POLICY``): LLaMA's attention and a shared expert split under tp, the router
and fused experts left whole, here for ``split_experts``, which splits them over tp as well.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist
from torch import nn

from kernels_runtime.api.parallelize import replaced_table
from kernels_runtime.inference.moe import ExpertSplit, serve_experts
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.plan import Plan
from kernels_runtime.parallel.state import ParallelState
from kernels_runtime.policies import Policy
from kernels_runtime.policies.moe import MOE_POLICY, expert_count, moe_blocks
from kernels_runtime.policies.moe_modulelist import ModuleListError, modulelist_blocks


def moe_policy(model: nn.Module) -> Policy | None:
    """The engine's policy for an HF MoE model, None for any other (its own policy applies)."""
    return MOE_POLICY if MOE_POLICY.matches(model) and moe_blocks(model) else None


def moe_problem(model: nn.Module, plan: Plan) -> str | None:
    """Why the engine cannot serve ``model`` under ``plan`` (validated) for its experts, or
    None. Dense models are refused only an ``ep`` (they have nothing to split)."""
    blocks = moe_blocks(model)
    if plan.ep > 1 and not blocks and _has_modulelist_experts(model):
        return (f"ep={plan.ep}: the engine splits fused experts (transformers' MoE models) "
                f"only; {type(model).__name__} keeps its experts in an nn.ModuleList, which "
                "the engine serves whole: use ep=1 (dp replicas, tp or pp)")
    if plan.ep > 1 and not blocks:
        return (f"ep={plan.ep} splits the experts of mixture-of-experts blocks, but "
                f"{type(model).__name__} has none; serve a dense model with dp replicas, tp "
                "or pp (ep=1)")
    if not blocks or (plan.ep == 1 and plan.tp == 1):
        return None
    if moe_policy(model) is None:
        return (f"the engine splits the experts of HF Mixtral, Qwen2-MoE and Qwen3-MoE models; "
                f"{type(model).__name__} is not one: serve it whole (ep=1, tp=1) or with pp")
    if plan.pp > 1:
        return (f"ep={plan.ep} tp={plan.tp} with pp={plan.pp} on a mixture-of-experts model is "
                "not available in the engine yet: split the experts with ep or tp alone")
    if plan.zero_stage == 3 or plan.offload != "none":
        return ("the engine splits experts from whole weights, which zero=3 and offload "
                "shard at rest: use zero<=2 without offload with ep or tp")
    for path, block, spec in blocks:
        experts = expert_count(block, spec)
        inter = int(getattr(block, spec.experts).gate_up_proj.shape[1]) // 2
        if experts % plan.ep:
            fits = [e for e in range(1, experts + 1) if experts % e == 0]
            return (f"ep={plan.ep} does not divide the {experts} experts of {path}: each rank "
                    f"of an ep group serves experts/ep of them; choose ep in {fits}")
        if inter % plan.tp:
            fits = [t for t in range(1, inter + 1) if inter % t == 0 and t <= 64]
            return (f"tp={plan.tp} does not divide the {inter} intermediate features of each "
                    f"expert of {path}: each tp rank serves a slice of every expert; choose "
                    f"tp in {fits}")
    return None


def _has_modulelist_experts(model: nn.Module) -> bool:
    """Whether ``model`` has a block the module-list reader reads (or refuses as malformed)."""
    try:
        return bool(modulelist_blocks(model))
    except ModuleListError:
        return True


def parallelized_problem(plan: Plan) -> str | None:
    """Why the engine cannot serve a model already parallelized under ``plan``, or None: one
    split by training's ep applier holds each rank's tokens apart (all-to-all dispatch), while
    the engine's ep ranks share one replica's tokens."""
    if plan.ep > 1:
        return (f"this model was parallelized for training under ep={plan.ep}; give the engine "
                f"the unparallelized model and the plan (Engine(model, 'ep={plan.ep}')), which "
                "splits the experts for serving")
    return None


def dense_context(ctx: ParallelContext) -> ParallelContext:
    """``ctx`` with ep folded into dp: what ``parallelize_model`` runs under for the engine
    (every rank of an ep group holds the non-expert weights, made equal over dp)."""
    if ctx.plan.ep == 1:
        return ctx
    return replace(ctx, plan=replace(ctx.plan, ep=1))


def split_experts(model: nn.Module, state: ParallelState, ctx: ParallelContext,
                  verbose: bool = False) -> None:
    """Give this rank its experts (E/ep of them, I/tp features each) under ``ctx``'s plan;
    with ``verbose`` the first rank prints what became of the blocks."""
    plan = ctx.plan
    if plan.ep == 1 and plan.tp == 1:
        return
    ep_rank = dist.get_group_rank(ctx.group("ep"), ctx.rank) if plan.ep > 1 else 0
    split = ExpertSplit(ep=plan.ep, ep_rank=ep_rank, tp=plan.tp, tp_rank=ctx.coord("tp"))
    groups = [ctx.group(axis) for axis, size in (("tp", plan.tp), ("ep", plan.ep)) if size > 1]
    swapped = serve_experts(model, split, ctx.comm, groups)
    state.replaced += swapped
    if verbose and swapped and ctx.rank == 0:
        print(replaced_table(swapped, plan))


@dataclass(frozen=True)
class Replicas:
    """The engine's replicas: ``count`` of them, this rank in replica ``index``; ``group``
    holds one rank of each (at this rank's place), over which outputs are gathered;
    ``first``: this rank is its replica's first along ep (it reports for the replica)."""

    count: int
    index: int
    group: dist.ProcessGroup | None
    first: bool = True


def replicas(ctx: ParallelContext, ep: int) -> Replicas:
    """dp replicas; under ep, each group of ep data-parallel ranks is one replica."""
    if ep == 1:
        return Replicas(ctx.dp_size, ctx.dp_rank, ctx.dp_group)
    return Replicas(ctx.dp_size // ep, ctx.dp_rank // ep, ctx.group("edp"),
                    ctx.dp_rank % ep == 0)

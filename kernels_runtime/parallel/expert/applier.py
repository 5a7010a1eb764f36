"""The expert-parallel applier: every sparse-MoE block becomes one holding experts/ep experts.

``parallelize`` runs it after tensor and sequence parallelism and before activation
checkpointing (which then wraps the blocks as they now are) when the plan's ``ep`` exceeds 1.
Which modules are MoE blocks, and which of their parts are router, experts and shared expert,
is the policy's data (``kernels_runtime.policies.moe``). Each swapped expert tensor is recorded
in ``state.replaced_params`` so the user's optimizer, built over the full fused tensors, finds
the slices, and its box of the global tensor in ``state.layouts`` (``layouts.py``) so checkpoints
save and reshard it; the data applier (``data_step.py``) then reduces the two kinds of parameter
over their own groups.

Not yet composed (each refused with the plan to use instead): tp or pp beside ep, offload,
and models whose weights a loader fills after parallelize.
"""

from __future__ import annotations

from torch import nn

from kernels_runtime.deferred_params import to_be_loaded
from kernels_runtime.parallel.expert.layouts import expert_layouts
from kernels_runtime.parallel.expert.moe_layer import ExpertParallelMoE
from kernels_runtime.parallel.state import ParallelState
from kernels_runtime.policies.moe import expert_count, moe_blocks


def check(state: ParallelState, model: nn.Module) -> str | None:
    """Why ep cannot run on ``model`` under this plan, or None."""
    plan = state.ctx.plan
    if plan.ep == 1:
        return None
    later = [what for what, on in (
        (f"tp={plan.tp}", plan.tp > 1), (f"pp={plan.pp}", plan.pp > 1),
        (f"offload={plan.offload}", plan.offload != "none"),
    ) if on]
    if later:
        return (f"ep={plan.ep} with {', '.join(later)} is not available yet; expert "
                "parallelism composes with dp and zero 0-3 today (e.g. 'ep=2 zero=1')")
    if to_be_loaded(model):
        return (f"ep={plan.ep} on a model whose weights are loaded after parallelize is not "
                "available yet; load the weights first, then parallelize")
    blocks = moe_blocks(model)
    if not blocks:
        return (f"ep={plan.ep} splits the experts of mixture-of-experts blocks, but "
                f"{type(model).__name__} has none (no module with a gate router and fused "
                "experts.gate_up_proj / down_proj); use ep=1 for a dense model")
    for path, block, spec in blocks:
        experts = expert_count(block, spec)
        if experts % plan.ep:
            fits = [e for e in range(1, experts + 1) if experts % e == 0]
            return (f"ep={plan.ep} does not divide the {experts} experts of {path}: each rank "
                    f"of an ep group holds experts/ep of them; choose ep in {fits}")
    return None


def apply(model: nn.Module, state: ParallelState) -> nn.Module:
    """Swap every MoE block for an ``ExpertParallelMoE`` over the context's ep group."""
    ctx = state.ctx
    if ctx.plan.ep == 1:
        return model
    for path, block, spec in moe_blocks(model):
        experts = getattr(block, spec.experts)
        swapped = ExpertParallelMoE(block, ctx.comm, ctx.group("ep"), spec, name=path)
        for name in ("gate_up_proj", "down_proj"):
            state.replaced_params[id(getattr(experts, name))] = getattr(swapped.experts, name)
        model.set_submodule(path, swapped)
        state.replaced.append((path, f"{type(block).__name__} -> ExpertParallelMoE "
                                     f"({expert_count(block, spec) // ctx.plan.ep} of "
                                     f"{expert_count(block, spec)} experts)"))
    state.layouts.update(expert_layouts(model, ctx))
    state.applied.append("expert")
    return model

"""The expert-parallel applier: every sparse-MoE block becomes one holding experts/ep experts.

``parallelize`` runs it after tensor and sequence parallelism and before activation
checkpointing (which then wraps the blocks as they now are) when the plan's ``ep`` exceeds 1.
Which modules are MoE blocks, and which of their parts are router, experts and shared expert,
is the policy's data (``kernels_runtime.policies.moe``). Each swapped expert tensor is recorded
in ``state.replaced_params`` so the user's optimizer, built over the full fused tensors, finds
the slices, and its box of the global tensor in ``state.layouts`` (``layouts.py``) so checkpoints
save and reshard it; the data applier (``data_step.py``) then reduces the two kinds of parameter
over their own groups. A block whose experts are a ModuleList behind a router ``nn.Linear``
(``policies/moe_modulelist.py``) keeps its rank's expert modules themselves instead
(``modulelist_layer.py``; dp and zero 0-3 so far, refused beside tp and pp).

Under tp (1D) each local expert is split over the tp group as well (``LocalExperts``: the
attention and any shared expert are the tensor applier's, the router stays replicated). Under
pp the blocks share one ``StageCarry`` (``router_stats.py``, in ``state.stage_carry``), whose
router sums the pipeline passes from stage to stage for the auxiliary loss.
Offload composes, static or automatic, beside tp too (``memory/expert_chunks.py``: a chunk
state per kind of parameter, both placed by one placer against the rank's ``device_mem`` and
``host_mem``, disk beyond). Not yet composed (each refused with what to use instead): sp,
sp_mode, a 2D / 2.5D tp grid (``Plan.validate``), offload without an optimizer
(``parallelize_model``: ``memory/offload.py``), and module-list experts whose weights a loader
fills after parallelize (fused experts built on meta are swapped on meta and filled box by box
by ``load_pretrained``: ``checkpoint/hf_experts.py``).
"""

from __future__ import annotations

from torch import nn

from kernels_runtime.deferred_params import to_be_loaded
from kernels_runtime.parallel.expert.layouts import expert_layouts
from kernels_runtime.parallel.expert.modulelist_layer import swap_modulelist_block
from kernels_runtime.parallel.expert.moe_layer import ExpertParallelMoE
from kernels_runtime.parallel.expert.router_stats import StageCarry
from kernels_runtime.parallel.state import ParallelState
from kernels_runtime.policies.moe import MoeSpec, expert_count, moe_blocks
from kernels_runtime.policies.moe_modulelist import ModuleListError, modulelist_blocks


def check(state: ParallelState, model: nn.Module) -> str | None:
    """Why ep cannot run on ``model`` under this plan, or None."""
    plan = state.ctx.plan
    if plan.ep == 1:
        return None
    blocks = moe_blocks(model)
    try:  # a router nn.Linear beside a ModuleList of experts (``policies/moe_modulelist.py``)
        listed = modulelist_blocks(model)
    except ModuleListError as error:
        return f"ep={plan.ep}: {error}"
    if to_be_loaded(model) and listed:  # fused experts load box by box (hf_experts.py)
        return (f"ep={plan.ep} on module-list experts whose weights are loaded after "
                "parallelize is not available yet; load the weights first, then parallelize")
    if not blocks and not listed:
        return (f"ep={plan.ep} splits the experts of mixture-of-experts blocks, but "
                f"{type(model).__name__} has none (no module with a gate router and fused "
                "experts.gate_up_proj / down_proj, nor a router nn.Linear beside an "
                "nn.ModuleList of expert MLPs); use ep=1 for a dense model")
    if listed and (plan.tp > 1 or plan.pp > 1 or listed[0][0] == ""):
        return (f"ep={plan.ep} on module-list experts ({listed[0][0] or 'the model itself'}) "
                "is available with dp and zero 0-3 only, inside a model: use tp=1 and pp=1 "
                "(or a model whose experts are fused, as transformers' MoE models)")
    for path, block, spec in blocks:
        experts = expert_count(block, spec)
        if experts % plan.ep:
            fits = [e for e in range(1, experts + 1) if experts % e == 0]
            return (f"ep={plan.ep} does not divide the {experts} experts of {path}: each rank "
                    f"of an ep group holds experts/ep of them; choose ep in {fits}")
        inter = int(getattr(block, spec.experts).down_proj.shape[-1])
        if inter % plan.tp:
            fits = [t for t in range(1, inter + 1) if inter % t == 0]
            return (f"tp={plan.tp} does not divide the intermediate size {inter} of the experts "
                    f"of {path}: under ep each expert is split over tp (gate/up by output, down "
                    f"by input); choose tp in {fits}")
    for path, _, reading in listed:
        if reading.num_experts % plan.ep:
            fits = [e for e in range(1, reading.num_experts + 1) if reading.num_experts % e == 0]
            return (f"ep={plan.ep} does not divide the {reading.num_experts} experts of {path}: "
                    f"each rank of an ep group holds experts/ep of them; choose ep in {fits}")
    return None


def apply(model: nn.Module, state: ParallelState) -> nn.Module:
    """Swap every MoE block for an ``ExpertParallelMoE`` over the context's ep group."""
    ctx = state.ctx
    if ctx.plan.ep == 1:
        return model
    blocks = moe_blocks(model)
    carry = None
    if ctx.plan.pp > 1:  # the auxiliary loss's sums travel with the activation
        path, block, spec = blocks[0]
        carry = StageCarry(expert_count(block, spec), _top_k(block, spec), ctx.comm,
                           ctx.dp_group)
        model.register_forward_pre_hook(carry.begin, with_kwargs=True)
        state.stage_carry = carry
    for path, block, spec in blocks:
        experts = getattr(block, spec.experts)
        swapped = ExpertParallelMoE(block, ctx.comm, ctx.group("ep"), spec, name=path,
                                    tp_group=ctx.group("tp") if ctx.plan.tp > 1 else None,
                                    carry=carry)
        for name in ("gate_up_proj", "down_proj"):
            state.replaced_params[id(getattr(experts, name))] = getattr(swapped.experts, name)
        model.set_submodule(path, swapped)
        state.replaced.append((path, f"{type(block).__name__} -> ExpertParallelMoE "
                                     f"({expert_count(block, spec) // ctx.plan.ep} of "
                                     f"{expert_count(block, spec)} experts)"))
    for path, block, reading in modulelist_blocks(model):
        swap_modulelist_block(model, path, block, reading, state)
    state.layouts.update(expert_layouts(model, ctx))
    state.applied.append("expert")
    return model


def _top_k(block: nn.Module, spec: MoeSpec) -> int:
    """The experts each token picks (the block's or its router's ``top_k``)."""
    return int(getattr(block, "top_k", getattr(getattr(block, spec.router), "top_k", 1)))

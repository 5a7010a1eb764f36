"""The sequence-parallel applier (second in ``parallelize``'s order, after tensor parallelism).

``sp_mode=split_gather`` puts the blocks of a tensor-parallel model on sequence shards inside
the tp group (``split_gather.py``). The sp-axis modes (Ulysses ``all_to_all``, ``ring``) split
the model's input over the sp ranks.
"""

from __future__ import annotations

from torch import nn

from kernels_runtime.parallel.sequence.split_gather import apply_split_gather
from kernels_runtime.parallel.state import ParallelState, not_available
from kernels_runtime.policies import find_module

HOW_TO = ("write a policy for it that names its blocks and attention (kernels_runtime.policies)"
          " or remove sp_mode")


def check(state: ParallelState, model: nn.Module) -> str | None:
    plan = state.ctx.plan
    if plan.sp_mode == "none":
        return None
    if plan.sp_mode != "split_gather":
        return not_available(f"sequence parallelism (sp={plan.sp}) with sp_mode={plan.sp_mode}")
    layout = state.policy.model_layout(model)
    if layout is None or layout.attention is None or find_module(model, layout.blocks) is None:
        return (f"sp_mode={plan.sp_mode}: the {state.policy.name} policy does not say where "
                f"{type(model).__name__}'s blocks and attention are; {HOW_TO}")
    return None


def apply(model: nn.Module, state: ParallelState) -> nn.Module:
    plan = state.ctx.plan
    if plan.sp_mode != "split_gather":
        return model
    layout = state.policy.model_layout(model)
    path, container = find_module(model, layout.blocks)
    state.replaced += apply_split_gather(model, state.ctx, list(container), path,
                                         layout.attention.path)
    state.applied.append("sequence")
    return model

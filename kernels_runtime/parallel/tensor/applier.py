"""The tensor-parallel applier (first in ``parallelize``'s order): 1D tensor parallelism by the
model's policy (``tensor_parallel.py``), or 2D / 2.5D on a grid (``grid_parallel.py``)."""

from __future__ import annotations

from torch import nn

from kernels_runtime.parallel.state import ParallelState
from kernels_runtime.parallel.tensor.grid_parallel import apply_grid_parallel
from kernels_runtime.parallel.tensor.tensor_parallel import apply_tensor_parallel
from kernels_runtime.policies import find_module

HOW_TO = ("write a policy for it (kernels_runtime.policies: a ModelLayout with a Rule per "
          "module, registered with register_policy) or use tp=1")


def check(state: ParallelState, model: nn.Module) -> str | None:
    plan = state.ctx.plan
    if plan.tp == 1:
        return None
    policy = state.policy
    layout = policy.model_layout(model)
    if layout is None or layout.extra.get("unreadable"):
        why = layout.extra["unreadable"] if layout is not None else "it has no layout"
        return (f"tp={plan.tp}: the {policy.name} policy cannot split "
                f"{type(model).__name__} ({why}); {HOW_TO}")
    resolved = policy.resolve(model)
    if not resolved.complete:
        return f"tp={plan.tp}: the {policy.name} policy does not fit this model: " \
               f"{resolved.problems()}; {HOW_TO}"
    return None  # head counts against tp: Plan.validate, from the policy's model_config


def apply(model: nn.Module, state: ParallelState) -> nn.Module:
    ctx = state.ctx
    if ctx.size("tp") == 1:
        return model  # every parameter stays whole (the default layout)
    policy = state.policy
    layout = policy.model_layout(model)
    resolved = policy.resolve(model)
    blocks = find_module(model, layout.blocks)
    attention = layout.attention
    heads, kv_heads = policy.attention_heads(model)
    if ctx.plan.tp_mode in ("2d", "2.5d"):
        found = find_module(model, layout.head) if layout.head else None
        after = tuple(f[0] for f in (find_module(model, c) for c in layout.pipeline.after) if f)
        layouts, replaced, params, head = apply_grid_parallel(
            model, ctx, resolved, attention, blocks[0] if blocks else None,
            found[0] if found else None, policy.model_config(model).get("hidden_size"), after)
    else:
        layouts, replaced, params, head = apply_tensor_parallel(
            model, ctx, resolved, attention, blocks[0] if blocks else None, heads, kv_heads)
    state.layouts.update(layouts)
    state.replaced = replaced
    state.replaced_params.update(params)
    state.vocab_head = head
    state.applied.append("tensor")
    return model

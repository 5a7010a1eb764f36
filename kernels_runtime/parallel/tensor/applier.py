"""The tensor-parallel applier (first in ``parallelize``'s order): 1D tensor parallelism by the
model's policy (``tensor_parallel.py``), or 2D / 2.5D on a grid (``grid_parallel.py``). Its
``check`` also refuses a swap that would drop a module attribute (``attributes.py``), before
any applier changes the model, and refuses LoRA adapters (a peft wrapper) where they cannot
split (``lora_refusals``)."""

from __future__ import annotations

from torch import nn

from kernels_runtime.parallel.state import ParallelState
from kernels_runtime.parallel.tensor.attributes import refusals
from kernels_runtime.parallel.tensor.grid_parallel import (
    apply_grid_parallel,
    grid_replicated,
    on_grid,
)
from kernels_runtime.parallel.tensor.lora import refusals as lora_layer_refusals
from kernels_runtime.parallel.tensor.tensor_parallel import (
    apply_tensor_parallel,
    modules_to_split,
)
from kernels_runtime.policies import Policy, ResolvedLayout, find_module, is_lora_layer
from kernels_runtime.policies.specs import ModelLayout

HOW_TO = ("write a policy for it (kernels_runtime.policies: a ModelLayout with a Rule per "
          "module, registered with register_policy) or use tp=1")


def check(state: ParallelState, model: nn.Module) -> str | None:
    plan = state.ctx.plan
    if plan.tp == 1:
        return None
    policy = state.policy
    resolved = policy.resolve(model)
    adapters = lora_refusals(state, model, resolved)
    if adapters:
        return f"tp={plan.tp}: " + "; ".join(adapters)
    layout = policy.model_layout(model)
    if layout is None or layout.extra.get("unreadable"):
        why = layout.extra["unreadable"] if layout is not None else "it has no layout"
        return (f"tp={plan.tp}: the {policy.name} policy cannot split "
                f"{type(model).__name__} ({why}); {HOW_TO}")
    if not resolved.complete:
        return f"tp={plan.tp}: the {policy.name} policy does not fit this model: " \
               f"{resolved.problems()}; {HOW_TO}"
    grid = None
    if plan.tp_mode in ("2d", "2.5d"):
        blocks, head, after = _grid_paths(model, layout)
        grid = (grid_replicated(resolved, blocks, head, after),
                on_grid(resolved, blocks, head, after), _hidden(policy, model))
    dropped = refusals(model, modules_to_split(resolved), grid)
    if dropped:
        return f"tp={plan.tp}: " + "; ".join(dropped)
    return None  # head counts against tp: Plan.validate, from the policy's model_config


def lora_refusals(state: ParallelState, model: nn.Module, resolved: ResolvedLayout,
                  ) -> list[str]:
    """Why the LoRA layers of ``model`` cannot split under this plan (none: they can, or it
    has none): 1D and the 2D / 2.5D grids split plain LoRA on linear layers (``lora.py``)."""
    split = {path.rpartition(".")[0]: specs["weight"]
             for path, specs in modules_to_split(resolved).items()
             if path.endswith(".base_layer") and "weight" in specs}
    layers = {p: model.get_submodule(p) for p in split}
    layers = {p: m for p, m in layers.items() if is_lora_layer(m)}
    if not layers:
        return []
    plan = state.ctx.plan
    _, kv_heads = state.policy.attention_heads(model)
    by_reason: dict[str, list[str]] = {}  # one message per reason, not per layer
    for path, layer in sorted(layers.items()):
        replicated = bool(plan.tp_mode == "1d" and split[path].kv and kv_heads  # 1D only
                          and kv_heads % plan.tp)
        for why in lora_layer_refusals(layer, split[path], replicated):
            by_reason.setdefault(why, []).append(path)
    return [f"{paths[0]}{f' and {len(paths) - 1} more LoRA layers' if len(paths) > 1 else ''}"
            f": {why}" for why, paths in by_reason.items()]


def _grid_paths(model: nn.Module, layout: ModelLayout,
                ) -> tuple[str | None, str | None, tuple[str, ...]]:
    """The blocks' path, the head's and those of the modules run after the blocks."""
    blocks = find_module(model, layout.blocks)
    head = find_module(model, layout.head) if layout.head else None
    after = tuple(f[0] for f in (find_module(model, c) for c in layout.pipeline.after) if f)
    return blocks[0] if blocks else None, head[0] if head else None, after


def _hidden(policy: Policy, model: nn.Module) -> int | None:
    return policy.model_config(model).get("hidden_size")


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
        blocks_path, head_path, after = _grid_paths(model, layout)
        layouts, replaced, params, head = apply_grid_parallel(
            model, ctx, resolved, attention, blocks_path, head_path, _hidden(policy, model),
            after)
    else:
        layouts, replaced, params, head = apply_tensor_parallel(
            model, ctx, resolved, attention, blocks[0] if blocks else None, heads, kv_heads)
    state.layouts.update(layouts)
    state.replaced = replaced
    state.replaced_params.update(params)
    state.vocab_head = head
    state.applied.append("tensor")
    return model

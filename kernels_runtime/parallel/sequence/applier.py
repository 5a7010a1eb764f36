"""The sequence-parallel applier (second in ``parallelize``'s order, after tensor parallelism).

``sp_mode=split_gather`` puts the blocks of a tensor-parallel model on sequence shards inside
the tp group (``split_gather.py``). The sp-axis modes split the model's input over the sp ranks
(``shard_inputs.py``) and route attention through ring attention or Ulysses
(``hf_attention.py``); their gradients are summed over sp by data parallelism, which folds the
sp axis into dp (``ParallelContext.fold_sp``).
"""

from __future__ import annotations

from torch import nn

from kernels_runtime.parallel.sequence import shard_inputs
from kernels_runtime.parallel.sequence.hf_attention import SequenceShard, install
from kernels_runtime.parallel.sequence.split_gather import apply_split_gather
from kernels_runtime.parallel.state import ParallelState
from kernels_runtime.policies import find_module

HOW_TO = ("write a policy for it that names its blocks and attention (kernels_runtime.policies)"
          " or remove sp_mode")
NAMES = {"ring": "ring attention", "all_to_all": "Ulysses all-to-all attention"}


def check(state: ParallelState, model: nn.Module) -> str | None:
    plan = state.ctx.plan
    if plan.sp_mode == "none":
        return None
    what = f"sp_mode={plan.sp_mode}"
    layout = state.policy.model_layout(model)
    if layout is None or layout.attention is None or find_module(model, layout.blocks) is None:
        return (f"{what}: the {state.policy.name} policy does not say where "
                f"{type(model).__name__}'s blocks and attention are; {HOW_TO}")
    if plan.sp_mode == "split_gather":
        return None
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return (f"{what} runs attention through transformers' attention interface, which "
                f"{type(model).__name__} does not use; use tp=N sp_mode=split_gather instead")
    if getattr(model, "main_input_name", "input_ids") != "input_ids":
        return (f"{what} splits the token sequence, but {type(model).__name__} takes "
                f"{model.main_input_name} (its sequence is made inside the model); split it "
                "with tp instead")
    heads, _ = state.policy.attention_heads(model)
    local = heads // plan.tp if heads else None
    if plan.sp_mode == "all_to_all" and local and local % plan.sp:
        return (f"{what} divides each rank's {local} attention heads (of {heads}, tp={plan.tp}) "
                f"over sp={plan.sp}; choose sp dividing {local}, or sp_mode=ring")
    return None


def apply(model: nn.Module, state: ParallelState) -> nn.Module:
    ctx, plan = state.ctx, state.ctx.plan
    if plan.sp_mode == "none":
        return model
    layout = state.policy.model_layout(model)
    path, container = find_module(model, layout.blocks)
    blocks = list(container)
    if plan.sp_mode == "split_gather":
        state.replaced += apply_split_gather(model, ctx, blocks, path, layout.attention.path)
    else:
        shard = SequenceShard(plan.sp_mode, ctx.comm, ctx.group("sp"), layout.attention.causal)
        attention = []
        for i, block in enumerate(blocks):
            found = find_module(block, layout.attention.path)
            if found is not None:
                attention.append(found[1])
                state.replaced.append((f"{path}.{i}.{found[0]}",
                                       f"attention -> {NAMES[plan.sp_mode]} over sp={plan.sp}"))
        install(model, attention, shard)
        state.sequence = shard
        body = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
        shard_inputs.register(model, body, shard, ctx.coord("sp"), plan.sp)
    state.applied.append("sequence")
    return model

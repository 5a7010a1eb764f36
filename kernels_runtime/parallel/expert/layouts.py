"""Where an expert slice lies in its global tensor: the layout checkpoints place it through.

A rank of an ep group holds experts [first, first + E/ep) of each block's fused tensors
(``gate_up_proj`` (E, 2I, h), ``down_proj`` (E, h, I)) under the HF names, so its local tensor
is one box of the global one along the expert dim, like a row-parallel weight is a box of its
weight under tensor parallelism. With tp inside the experts (``LocalExperts``) it is also this
tp rank's features: two boxes of ``gate_up_proj`` (its gate rows and its up rows, side by
side locally, I apart globally), one of ``down_proj``, sharded along "tp" as well. Recording
those boxes as the parameter's ``ParamLayout`` is all a checkpoint needs: savers write global
boxes, the reader reshards them into whatever boxes another ep (or one plain process) asks
for, as it does for tp shards.

On the plan's mesh the ep ranks are dp ranks, so the layout is sharded along "dp", and the
dp/ep ranks of an expert-data group holding the same box are its replicas
(``ParamLayout.replica``): a saver splits the box among them, a gradient norm counts one.
The two data strategies see the slices differently, and each gets the layout in its own terms:

- ZeRO 0-2 reduce and shard expert slices on the expert-data view of the context, whose "dp"
  is the expert-data group (``grad_sync.expert_data_context``): there the box is replicated
  along "dp" (ZeRO 1-2 then shard it there), with no inner replicas (``on_expert_data``).
- ZeRO-3 shards each slice over the expert-data group (FSDP2, ``zero3.py``): the replicas
  become distinct dp shards, so the layout keeps "dp" and drops its replicas (``under_fsdp``).
"""

from __future__ import annotations

from dataclasses import replace

import torch.distributed as dist
from torch import nn

from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.shards import ParamLayout
from kernels_runtime.parallel.expert.moe_layer import LocalExperts


def expert_layouts(model: nn.Module, ctx: ParallelContext) -> dict[str, ParamLayout]:
    """The layout of every local expert tensor of ``model`` on the plan's mesh, by name."""
    edp = ctx.group("edp")
    replica = (dist.get_group_rank(edp, dist.get_rank()), dist.get_world_size(edp))
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, LocalExperts):
            own = getattr(module, "slice_layouts", None)  # module-list experts: whole tensors
            for name, layout in (own() if own else _slice_layouts(module)).items():
                out[f"{path}.{name}"] = replace(layout, replica=replica)
    return out


def _slice_layouts(experts: LocalExperts) -> dict[str, ParamLayout]:
    """Where a rank's slices lie: experts [first, first + E/ep) along dim 0 and this tp
    rank's I/tp features (all of them without tp)."""
    e, sharded = experts.gate_up_proj.shape[0], frozenset({"dp"})
    h, inter, part = experts.down_proj.shape[1], experts.inter, experts.inter // experts.tp
    at = experts.tp_rank * part
    if experts.tp > 1:
        sharded |= {"tp"}
    gate_up = ParamLayout(
        (experts.num_experts, 2 * inter, h),
        (((0, 0, 0), (experts.first, at, 0), (e, part, h)),  # gate rows
         ((0, part, 0), (experts.first, inter + at, 0), (e, part, h))),  # up rows
        sharded)
    down = ParamLayout.box((experts.num_experts, h, inter), (experts.first, 0, at),
                           (e, h, part), sharded)
    return {"gate_up_proj": gate_up, "down_proj": down}


def on_expert_data(layouts: dict[str, ParamLayout], names: set[str]) -> dict[str, ParamLayout]:
    """``layouts`` with the expert ones (``names``) as the expert-data view sees them."""
    return {n: replace(layout, sharded=layout.sharded - {"dp"}, replica=(0, 1))
            if n in names else layout for n, layout in layouts.items()}


def under_fsdp(layouts: dict[str, ParamLayout], names: set[str]) -> dict[str, ParamLayout]:
    """``layouts`` with the expert ones (``names``) sharded over expert-dp by FSDP2."""
    return {n: replace(layout, replica=(0, 1)) if n in names else layout
            for n, layout in layouts.items()}

"""Where an expert slice lies in its global tensor: the layout checkpoints place it through.

A rank of an ep group holds experts [first, first + E/ep) of each block's fused tensors
(``gate_up_proj`` (E, 2I, h), ``down_proj`` (E, h, I)) under the HF names, so its local tensor
is one box of the global one along the expert dim, like a row-parallel weight is a box of its
weight under tensor parallelism. Recording that box as the parameter's ``ParamLayout`` is all a
checkpoint needs: savers write global boxes, the reader reshards them into whatever boxes
another ep (or one plain process) asks for, as it does for tp shards.

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

FUSED = ("gate_up_proj", "down_proj")


def expert_layouts(model: nn.Module, ctx: ParallelContext) -> dict[str, ParamLayout]:
    """The layout of every local expert tensor of ``model`` on the plan's mesh, by name."""
    edp = ctx.group("edp")
    replica = (dist.get_group_rank(edp, dist.get_rank()), dist.get_world_size(edp))
    out = {}
    for path, module in model.named_modules():
        if not isinstance(module, LocalExperts):
            continue
        for name in FUSED:
            local = tuple(getattr(module, name).shape)  # (E/ep, ...)
            full = (module.num_experts, *local[1:])  # (E, ...)
            offsets = (module.first,) + (0,) * (len(local) - 1)
            out[f"{path}.{name}"] = replace(
                ParamLayout.box(full, offsets, local, frozenset({"dp"})), replica=replica)
    return out


def on_expert_data(layouts: dict[str, ParamLayout], names: set[str]) -> dict[str, ParamLayout]:
    """``layouts`` with the expert ones (``names``) as the expert-data view sees them."""
    return {n: replace(layout, sharded=layout.sharded - {"dp"}, replica=(0, 1))
            if n in names else layout for n, layout in layouts.items()}


def under_fsdp(layouts: dict[str, ParamLayout], names: set[str]) -> dict[str, ParamLayout]:
    """``layouts`` with the expert ones (``names``) sharded over expert-dp by FSDP2."""
    return {n: replace(layout, replica=(0, 1)) if n in names else layout
            for n, layout in layouts.items()}

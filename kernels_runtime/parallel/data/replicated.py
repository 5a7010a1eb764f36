"""The model state of a data-parallel model without an optimizer (evaluation, inference).

Under zero 0-2 every data-parallel rank holds whole parameters (ZeRO shards only gradients and
optimizer states, and there are none), so a rank's pieces are its parameters as the earlier
appliers laid them out; when saving, the replicas of each parameter write one part of it each.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.plan import AXES
from kernels_runtime.mesh.shards import ParamLayout
from kernels_runtime.optim import PARAM, StatePiece
from kernels_runtime.optim.state import layout_replica, written_part


class ReplicatedState:
    def __init__(self, model: nn.Module, ctx: ParallelContext,
                 layouts: dict[str, ParamLayout]) -> None:
        self.model, self.ctx = model, ctx
        self.layouts = {n: layouts.get(n) or ParamLayout.replicated(tuple(p.shape))
                        for n, p in model.named_parameters()}

    def pieces(self, saving: bool, optimizer: torch.optim.Optimizer | None) -> list[StatePiece]:
        if optimizer is not None:
            raise ValueError("a model parallelized without an optimizer has no optimizer state")
        out = []
        sizes = {a: self.ctx.size(a) for a in AXES}
        for name, p in self.model.named_parameters():
            layout = self.layouts[name]
            box = ((0,) * p.dim(), tuple(p.shape))
            if saving:
                replicated = [a for a in AXES if a not in layout.sharded]
                index, count = layout_replica(layout, self.ctx.coords, sizes, replicated)
                box = written_part(*box, index, count)
                if box is None:
                    continue
            local = p.detach()[tuple(slice(o, o + s) for o, s in zip(*box))]
            for shard, where in layout.shards(name, box):
                out.append(StatePiece(shard, {PARAM: local[where]}))
        return out

    def after_load(self) -> None:
        """Every rank loaded its whole parameters: nothing to propagate."""

"""ZeRO-3 through PyTorch's FSDP2 (``fully_shard``): parameters sharded at rest, gathered per
transformer block for forward and backward, freed after.

FSDP2 already does what ZeRO-3 needs (per-block all-gather with prefetch, reduce-scatter of
gradients, fp32 sharded parameters as the master copy with ``MixedPrecisionPolicy``), so we use
it rather than re-implement it, and keep the shared step logic (fp16 loss scaling with an
overflow vote, global-norm clipping across shards) in ``BoostedOptimizer``. Blocks come from
the model's policy; a model without known blocks is sharded as one unit.

Each parameter's local shard is a dim-0 slice of the tensor earlier appliers left (the whole
parameter, or a tensor-parallel shard of it), placed in the global tensor by its layout.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from kernels_runtime.deferred_params import move_real, to_be_loaded
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.plan import AXES
from kernels_runtime.mesh.shards import ParamLayout
from kernels_runtime.optim import (
    PARAM,
    GradShard,
    GradSync,
    StatePiece,
    optimizer_state_tensors,
    tensor_bytes,
)
from kernels_runtime.optim.state import layout_replica, state_views, written_part
from kernels_runtime.parallel.data.fsdp_comms import record_fsdp_comms
from kernels_runtime.parallel.data.zero import named_param_groups
from kernels_runtime.precision import compute_dtype


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def shard_model(model: nn.Module, blocks: list[nn.Module], ctx: ParallelContext,
                precision: str) -> nn.Module:
    """Apply ``fully_shard`` to every block, then to the root, over the dp axis. Deferred
    (meta) parameters of a model ``to_be_loaded`` are sharded on meta and only this rank's
    dim-0 shards get storage (``_allocate_shards``)."""
    dtype = compute_dtype(precision)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    mesh = ctx.data_mesh()
    move_real(model, ctx.device)  # meta parameters stay meta: fully_shard takes them so
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if to_be_loaded(model):
        _allocate_shards(model, ctx.device)
    record_fsdp_comms([*blocks, model], ctx.comm)  # telemetry sees ZeRO-3's traffic too
    return model


def _allocate_shards(model: nn.Module, device: torch.device) -> None:
    """Zeros for the local shards of meta parameters, through FSDP2's own ``to_empty`` (it
    re-pads its shards after). ``to_empty`` also empties buffers and real parameters, which
    hold computed values (rotary frequencies): they are put back."""
    buffers = [(m, n, b) for m in model.modules() for n, b in m.named_buffers(recurse=False)]
    real = [(m, n, p.detach()) for m in model.modules()  # detached: the old storage
            for n, p in m.named_parameters(recurse=False) if not p.is_meta]
    meta = {n for n, p in model.named_parameters() if p.is_meta}
    model.to_empty(device=device)
    with torch.no_grad():
        for m, n, b in buffers:
            m._buffers[n] = b
        for m, n, old in real:
            p = getattr(m, n)
            if isinstance(p, DTensor):
                p.copy_(old)
            else:
                p.data = old
        for n, p in model.named_parameters():
            if n in meta:
                _local(p).zero_()


class FsdpState:
    """The pieces of a ``fully_shard``-ed model: each parameter's local dim-0 shard (model-only
    use: evaluation and inference under zero=3)."""

    def __init__(self, model: nn.Module, ctx: ParallelContext,
                 layouts: dict[str, ParamLayout]) -> None:
        self.model, self.ctx = model, ctx
        self.layouts = {n: layouts.get(n) or ParamLayout.replicated(tuple(p.shape))
                        for n, p in model.named_parameters()}

    def _box(self, p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
        local = _local(p)
        if not isinstance(p, DTensor):
            return (0,) * p.dim(), tuple(p.shape)
        _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return tuple(offset), tuple(local.shape)

    def pieces(self, saving: bool, optimizer: torch.optim.Optimizer | None) -> list[StatePiece]:
        out = []
        for name, p in self.model.named_parameters():
            layout = self.layouts[name]
            offsets, sizes = self._box(p)
            if saving:  # the dp shard is replicated along the axes the layout does not shard
                replicated = [a for a in AXES if a != "dp" and a not in layout.sharded]
                index, count = layout_replica(layout, self.ctx.coords,
                                              {a: self.ctx.size(a) for a in AXES}, replicated)
                part = written_part(offsets, sizes, index, count)
                if part is None:
                    continue
            else:
                part = (offsets, sizes)
            if 0 in part[1] and p.dim():
                continue
            local = _local(p)
            for shard, where in layout.shards(name, part):

                def view(t: torch.Tensor, part=part, offsets=offsets, where=where) -> torch.Tensor:
                    t = _local(t)
                    held = tuple(slice(o - base, o - base + s)
                                 for o, base, s in zip(part[0], offsets, part[1]))
                    return t[held][where]

                values = {PARAM: view(local), **state_views(optimizer, p, view)}
                out.append(StatePiece(shard, values))
        return out

    def after_load(self) -> None:
        """Shards are the parameters: the next forward all-gathers them."""


class FsdpGradSync(FsdpState, GradSync):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext,
                 layouts: dict[str, ParamLayout], *, blocks: list[nn.Module],
                 precision: str, replaced: dict[int, nn.Parameter] | None = None) -> None:
        self._group_names = [[n for n, _ in g]
                             for g in named_param_groups(model, optimizer, replaced)]
        super().__init__(shard_model(model, blocks, ctx, precision), ctx, layouts)
        self.params = dict(self.model.named_parameters())  # new DTensor parameters, same names

    def master_groups(self) -> list[list[torch.Tensor]]:
        return [[self.params[n] for n in g] for g in self._group_names]

    def prepare_backward(self, sync: bool) -> None:
        self.model.set_requires_gradient_sync(sync)

    def finish(self) -> None:
        """FSDP2 reduce-scatters during backward and waits at its end."""

    def master_grads(self) -> list[GradShard]:
        out = []
        for name, p in self.params.items():
            if p.grad is not None:
                layout = self.layouts[name]
                out.append(GradShard(_local(p.grad), layout.sharded | {"dp"},
                                     layout.replica[0] == 0))
        return out

    def publish(self) -> None:
        """Parameters are the sharded fp32 masters: the next forward all-gathers them."""

    def zero_grads(self) -> None:
        for p in self.params.values():
            p.grad = None

    def memory_breakdown(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        params = [_local(p) for p in self.model.parameters()]
        grads = [_local(p.grad) for p in self.model.parameters() if p.grad is not None]
        states = [_local(t) for t in optimizer_state_tensors(optimizer)]
        return {"params": tensor_bytes(params), "grads": tensor_bytes(grads),
                "optimizer": tensor_bytes(states)}

"""ZeRO-3 through PyTorch's FSDP2 (``fully_shard``): parameters sharded at rest, gathered per
transformer block for forward and backward, freed after.

FSDP2 already does what ZeRO-3 needs (per-block all-gather with prefetch, reduce-scatter of
gradients, fp32 sharded parameters as the master copy with ``MixedPrecisionPolicy``), so we use
it rather than re-implement it, and keep the shared step logic (fp16 loss scaling with an
overflow vote, global-norm clipping across shards) in ``BoostedOptimizer``. Blocks come from
the model's policy; a model without known blocks is sharded as one unit.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from kernels_runtime.api.optimizer import (
    BoostedOptimizer,
    Segment,
    SegmentValues,
    optimizer_state_tensors,
    rebuild_optimizer,
    tensor_bytes,
)
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.parallel.data.fsdp_comms import record_fsdp_comms
from kernels_runtime.precision import compute_dtype


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def shard_model(model: nn.Module, blocks: list[nn.Module], ctx: ParallelContext,
                precision: str) -> nn.Module:
    """Apply ``fully_shard`` to every block, then to the root, over the dp axis."""
    dtype = compute_dtype(precision)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    mesh = ctx.mesh["dp"]
    model.to(ctx.device)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    record_fsdp_comms([*blocks, model], ctx.comm)  # telemetry sees ZeRO-3's traffic too
    return model


class FsdpOptimizer(BoostedOptimizer):
    _grads_sharded = True

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        ctx: ParallelContext,
        *,
        blocks: list[nn.Module],
        precision: str,
        max_grad_norm: float | None = None,
    ) -> None:
        super().__init__(ctx, precision, max_grad_norm)
        names = {id(p): n for n, p in model.named_parameters()}
        group_names = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        self.model = shard_model(model, blocks, ctx, precision)
        params = dict(self.model.named_parameters())  # new DTensor parameters, same names
        self.inner = rebuild_optimizer(optimizer, [[params[n] for n in g] for g in group_names])

    def backward(self, loss: torch.Tensor) -> None:
        self.model.set_requires_gradient_sync(self.sync_grads)
        super().backward(loss)

    def _finish_grad_sync(self) -> None:
        """FSDP2 reduce-scatters during backward and waits at its end."""

    def _master_grads(self) -> list[torch.Tensor]:
        return [_local(p.grad) for g in self.inner.param_groups for p in g["params"]
                if p.grad is not None]

    def _publish_params(self) -> None:
        """Parameters are the sharded fp32 masters: the next forward all-gathers them."""

    def _zero_grads(self) -> None:
        self.inner.zero_grad(set_to_none=True)

    # ---- checkpoint surface ------------------------------------------------------------
    def _local_ranges(self) -> list[tuple[Segment, nn.Parameter]]:
        """Each parameter's local dim-0 shard is one contiguous flat range of the parameter."""
        out = []
        for name, p in self.model.named_parameters():
            local = _local(p)
            if isinstance(p, DTensor):
                _, offset = compute_local_shape_and_global_offset(
                    p.shape, p.device_mesh, p.placements)
                row = math.prod(p.shape[1:]) if p.dim() > 1 else 1
                start = offset[0] * row if p.dim() else 0
            else:
                start = 0
            out.append((Segment(name, tuple(p.shape), start, start + local.numel()), p))
        return [(seg, p) for seg, p in out if seg.numel > 0]

    def saved_segments(self) -> list[tuple[Segment, SegmentValues]]:
        out = []
        for seg, p in self._local_ranges():
            values = {"master": _local(p).detach().float().reshape(-1)}
            for k, v in self.inner.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    values[k] = _local(v).reshape(-1)
            out.append((seg, values))
        return out

    def needed_segments(self) -> list[Segment]:
        return [seg for seg, _ in self._local_ranges()]

    def load_segments(self, fetch: Callable[[Segment], SegmentValues]) -> None:
        self.materialize_state()
        with torch.no_grad():
            for seg, p in self._local_ranges():
                values = fetch(seg)
                _local(p).reshape(-1).copy_(values["master"])
                for k, v in self.inner.state[p].items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        _local(v).reshape(-1).copy_(values[k])

    def memory_breakdown(self) -> dict[str, int]:
        params = [_local(p) for p in self.model.parameters()]
        grads = [_local(p.grad) for p in self.model.parameters() if p.grad is not None]
        states = [_local(t) for t in optimizer_state_tensors(self.inner)]
        return {"params": tensor_bytes(params), "grads": tensor_bytes(grads),
                "optimizer": tensor_bytes(states)}

"""Data parallelism with ZeRO stages 0, 1 and 2 on flat buckets (Rajbhandari et al. 2019).

| stage | parameters | gradients kept per rank | optimizer states + fp32 master |
|---|---|---|---|
| 0 (DDP) | full | full, all-reduced | full |
| 1 | full | full locally; own shard reduce-scattered at the last micro-batch | own shard |
| 2 | full | own shard only: reduce-scattered after every micro-batch | own shard |

Gradient reduction overlaps backward: a post-accumulate-grad hook marks parameters ready and a
bucket's collective starts as soon as all its parameters have gradients, in bucket order (every
rank must issue collectives in the same order). A callback queued on the autograd engine
starts what is left at the end of backward (parameters unused in this pass count as zero) and
waits for all of it. Micro-batches inside ``no_sync()`` communicate nothing at stages 0 and 1;
stage 2 reduce-scatters every micro-batch, trading communication for 1/dp gradient memory.

Parameters are the tensors earlier appliers left (tensor-parallel shards, a stage's layers):
buckets group parameters with the same sharding (``ParamLayout.signature``), and the state
pieces of a bucket are placed in the global tensors through each parameter's layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd import Variable

from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.plan import AXES
from kernels_runtime.mesh.shards import ParamLayout, flat_range_boxes
from kernels_runtime.optim import (
    PARAM,
    GradShard,
    GradSync,
    StatePiece,
    check_elementwise,
    optimizer_state_tensors,
    tensor_bytes,
)
from kernels_runtime.optim.state import layout_replica, state_views
from kernels_runtime.parallel.data import zero_comms
from kernels_runtime.parallel.data.buckets import Bucket, build_buckets
from kernels_runtime.precision import compute_dtype


def named_param_groups(
    model: nn.Module, optimizer: torch.optim.Optimizer | None,
    replaced: dict[int, nn.Parameter] | None = None,
) -> list[list[tuple[str, nn.Parameter]]]:
    """The optimizer's param groups as (name, parameter) lists, trainable ones only; without
    an optimizer (weights for inference), one group of the model's trainable parameters.

    ``replaced`` maps parameters an earlier applier swapped (tensor-parallel shards) from the
    id of the one the optimizer was built over to the model's new one; tied parameters the
    optimizer lists once stay once."""
    replaced = replaced or {}
    params = {id(p): (n, p) for n, p in model.named_parameters()}
    groups, seen = [], set()
    param_groups = optimizer.param_groups if optimizer is not None else \
        [{"params": [p for _, p in params.values()]}]
    for group in param_groups:
        current = [replaced.get(id(p), p) for p in group["params"]]
        missing = [p for p in current if id(p) not in params]
        if missing:
            raise ValueError("the optimizer holds parameters that are not in the model; build "
                             "it from model.parameters() of the model passed to parallelize")
        named = []
        for p in current:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                named.append(params[id(p)])
        groups.append(named)
    return groups


@dataclass
class DpShards:
    """What every strategy that shards over dp starts from (flat buckets here, offload's
    chunks): stage, compute dtype, dp coordinates, a layout for every trainable parameter and
    the optimizer's named param groups (without an optimizer, offload's weights for
    inference: one group)."""

    stage: int
    dtype: torch.dtype
    dp: int
    dp_rank: int
    layouts: dict[str, ParamLayout]
    groups: list[list[tuple[str, nn.Parameter]]]


def shard_over_dp(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: ParallelContext,
    layouts: dict[str, ParamLayout], zero_stage: int, precision: str,
    replaced: dict[int, nn.Parameter] | None,
) -> DpShards:
    """The element-wise check, then a ``DpShards`` for this rank."""
    if optimizer is not None:
        check_elementwise(optimizer)
    groups = named_param_groups(model, optimizer, replaced)
    return DpShards(
        stage=zero_stage, dtype=compute_dtype(precision), dp=ctx.dp_size, dp_rank=ctx.dp_rank,
        layouts={n: layouts.get(n) or ParamLayout.replicated(tuple(p.shape))
                 for g in groups for n, p in g},
        groups=groups)


def _nothing() -> None:
    return None


class ZeroGradSync(GradSync):
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        ctx: ParallelContext,
        layouts: dict[str, ParamLayout],
        *,
        zero_stage: int,
        precision: str,
        bucket_mb: float = 8.0,
        replaced: dict[int, nn.Parameter] | None = None,
    ) -> None:
        shards = shard_over_dp(model, optimizer, ctx, layouts, zero_stage, precision, replaced)
        self.ctx, self.stage, self.dtype = ctx, shards.stage, shards.dtype
        self.dp, self.dp_rank, self.layouts = shards.dp, shards.dp_rank, shards.layouts
        groups = shards.groups
        model.to(ctx.device)
        self.buckets = build_buckets(groups, self.dp, int(bucket_mb * 2**20),
                                     key=lambda name: self.layouts[name].signature)
        self.masters = [self._make_master(b) for b in self.buckets]
        if self.dtype != torch.float32:
            for b in self.buckets:
                _cast_bucket(b, self.dtype)
            cast_params(model, self.dtype)
        self._grad_store = [self._make_grad_store(b) for b in self.buckets]
        # outside every bucket: counted as model state (a LoRA base is most of it)
        self._frozen = [p for p in model.parameters() if not p.requires_grad]
        self._groups = len(groups)
        self._slot = {id(p): (b.index, off) for b in self.buckets
                      for p, off in zip(b.params, b.offsets)}
        self._ready = [0] * len(self.buckets)
        self._next_launch = 0
        self._pending: list[zero_comms.Finish] = []
        self._in_backward = False
        self._synced_since_step = False
        self._sync = True
        # how many bucket reductions started while backward was still running vs at its end
        self.overlap = {"during_backward": 0, "at_end": 0}
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    # ---- construction helpers ------------------------------------------------------------
    def _make_master(self, b: Bucket) -> torch.Tensor:
        """The fp32 tensor the inner optimizer updates: the full bucket (stage 0) or this rank's
        shard. In fp32 it is a view of the parameters themselves: no copy."""
        shard = slice(*b.shard_range(self.dp_rank)) if self.stage else slice(None)
        flat = b.flat_param[shard]
        return flat if self.dtype == torch.float32 else flat.detach().clone()

    def _make_grad_store(self, b: Bucket) -> torch.Tensor:
        """Stages 0/1: a full flat gradient buffer the parameters' ``.grad`` are views of.
        Stage 2: only this rank's shard."""
        size = b.shard_size if self.stage == 2 else b.padded
        return torch.zeros(size, dtype=self.dtype, device=b.flat_param.device)

    def master_groups(self) -> list[list[torch.Tensor]]:
        return [[m for b, m in zip(self.buckets, self.masters) if b.group_index == g]
                for g in range(self._groups)]

    # ---- backward hooks ------------------------------------------------------------------
    def prepare_backward(self, sync: bool) -> None:
        self._sync = sync

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._in_backward:
            self._in_backward = True
            Variable._execution_engine.queue_callback(self._end_of_backward)
        i, off = self._slot[id(p)]
        if self.stage < 2:
            view = self._grad_store[i][off:off + p.numel()].view_as(p)
            if p.grad.data_ptr() != view.data_ptr():  # someone reset .grad: take it back
                view.copy_(p.grad)
                p.grad = view
        self._ready[i] += 1
        if self._syncing():
            self._launch_ready()

    def _syncing(self) -> bool:
        return self._sync or self.stage == 2

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if self._ready[b.index] < len(b.params):
                return
            self._launch(b)
            self.overlap["during_backward"] += 1

    def _launch(self, b: Bucket) -> None:
        comm, group = self.ctx.comm, self.ctx.dp_group
        store = self._grad_store[b.index]
        if self.stage == 0 and self.dp == 1:
            finish = _nothing  # one replica (dp=1 under tp or pp): no reduction, no call
        elif self.stage == 0:
            finish = zero_comms.start_all_reduce(comm, group, store, self.dp)
        elif self.stage == 1:
            shard = store[slice(*b.shard_range(self.dp_rank))]
            finish = zero_comms.start_reduce_scatter(comm, group, store, self.dp, shard, False)
        else:
            flat = zero_comms.flatten_grads(b, torch.float32)
            for p in b.params:
                p.grad = None  # the full gradient is not kept: only this rank's shard is
            finish = zero_comms.start_reduce_scatter(comm, group, flat, self.dp, store, True)
        self._pending.append(finish)
        self._next_launch += 1

    def _end_of_backward(self) -> None:
        self._in_backward = False
        if self.stage == 1 and self._sync:
            if self._synced_since_step:
                raise RuntimeError(
                    "zero=1 reduces gradients once per step: run every backward but the last of "
                    "a step inside `with optimizer.no_sync():` (train_step does this)")
            self._synced_since_step = True
        if self._syncing():
            while self._next_launch < len(self.buckets):
                self._launch(self.buckets[self._next_launch])
                self.overlap["at_end"] += 1
            self._drain()
        self._ready = [0] * len(self.buckets)

    def reduce_now(self) -> None:
        """Start every bucket's reduction now and wait: the end of a pipeline stage's backwards,
        which all ran inside ``no_sync`` (zero 0 and 1 only; a plan refuses zero 2 with pp)."""
        previous, self._sync = self._sync, True
        try:
            self._end_of_backward()
        finally:
            self._sync = previous

    def _drain(self) -> None:
        pending, self._pending = self._pending, []
        for finish in pending:
            finish()
        self._next_launch = 0

    # ---- step hooks ----------------------------------------------------------------------
    def finish(self) -> None:
        if self._next_launch or self._pending:
            self._drain()

    def _sharded_axes(self, b: Bucket) -> frozenset[str]:
        own = self.layouts[b.names[0]].sharded
        return own | {"dp"} if self.stage else own

    def master_grads(self) -> list[GradShard]:
        grads = []
        for b, master, store in zip(self.buckets, self.masters, self._grad_store):
            g = store if self.stage != 1 else store[slice(*b.shard_range(self.dp_rank))]
            master.grad = g if g.dtype == torch.float32 else g.float()
            grads.append(GradShard(master.grad, self._sharded_axes(b),
                                   self.layouts[b.names[0]].replica[0] == 0))
        return grads

    def publish(self) -> None:
        gathers = []
        for b, master in zip(self.buckets, self.masters):
            if self.stage == 0:
                if master.data_ptr() != b.flat_param.data_ptr():
                    b.flat_param.copy_(master)
                continue
            shard = b.flat_param[slice(*b.shard_range(self.dp_rank))]
            if master.data_ptr() != shard.data_ptr():
                shard.copy_(master)
            gathers.append(zero_comms.start_param_all_gather(
                self.ctx.comm, self.ctx.dp_group, b, self.dp_rank))
        for wait in gathers:
            wait()

    def zero_grads(self) -> None:
        self._synced_since_step = False
        for b, store in zip(self.buckets, self._grad_store):
            store.zero_()
            for p, off in zip(b.params, b.offsets):
                p.grad = store[off:off + p.numel()].view_as(p) if self.stage < 2 else None
        for m in self.masters:
            m.grad = None

    # ---- model state ---------------------------------------------------------------------
    def _range(self, b: Bucket, saving: bool) -> tuple[int, int, int]:
        """(start, end) of the bucket's flat range this rank holds or writes, and the flat
        offset where its master starts. Replicas of a range (every dp rank at stage 0, other
        axes the bucket's parameters are replicated over) each write one part of it."""
        base = 0 if self.stage == 0 else b.shard_range(self.dp_rank)[0]
        start, end = (0, b.padded) if self.stage == 0 else b.shard_range(self.dp_rank)
        if saving:
            sharded = self._sharded_axes(b)
            replicated = [a for a in AXES if a not in sharded]
            index, count = layout_replica(self.layouts[b.names[0]], self.ctx.coords,
                                          {a: self.ctx.size(a) for a in AXES}, replicated)
            span = end - start
            start, end = start + span * index // count, start + span * (index + 1) // count
        return start, end, base

    def pieces(self, saving: bool, optimizer: torch.optim.Optimizer | None) -> list[StatePiece]:
        out = []
        for b, master in zip(self.buckets, self.masters):
            start, end, base = self._range(b, saving)
            for i, lo, hi in b.segments(start, end):
                name, layout = b.names[i], self.layouts[b.names[i]]
                local_shape = tuple(b.params[i].shape)
                for box, flat in flat_range_boxes(local_shape, lo, hi):
                    at = b.offsets[i] + flat - base
                    for shard, where in layout.shards(name, box):

                        def view(t: torch.Tensor, at: int = at, sizes: tuple = box[1],
                                 where: tuple = where) -> torch.Tensor:
                            return t[at:at + math.prod(sizes)].view(sizes)[where]

                        values = {PARAM: view(master), **state_views(optimizer, master, view)}
                        out.append(StatePiece(shard, values))
        return out

    def memory_breakdown(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        params = tensor_bytes([b.flat_param for b in self.buckets] + self._frozen)
        grads = tensor_bytes(self._grad_store)
        masters = [m for b, m in zip(self.buckets, self.masters)
                   if m.untyped_storage().data_ptr() != b.flat_param.untyped_storage().data_ptr()]
        states = tensor_bytes(optimizer_state_tensors(optimizer) + masters)
        return {"params": params, "grads": grads, "optimizer": states}


def cast_params(model: nn.Module, dtype: torch.dtype) -> None:
    """Parameters outside the buckets (frozen ones; all of them without an optimizer) follow
    the compute dtype; buffers such as rotary frequencies stay in fp32, as under FSDP2's mixed
    precision."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def _cast_bucket(b: Bucket, dtype: torch.dtype) -> None:
    """Store the bucket's parameters in ``dtype``; the parameters stay views of it."""
    b.flat_param = b.flat_param.to(dtype)
    for p, off in zip(b.params, b.offsets):
        p.data = b.flat_param[off:off + p.numel()].view_as(p)

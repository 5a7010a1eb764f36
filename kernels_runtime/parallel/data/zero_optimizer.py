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
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.autograd import Variable

from kernels_runtime.api.optimizer import (
    BoostedOptimizer,
    Segment,
    SegmentValues,
    check_elementwise,
    optimizer_state_tensors,
    rebuild_optimizer,
    tensor_bytes,
)
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.parallel.data import zero_comms
from kernels_runtime.parallel.data.buckets import Bucket, build_buckets
from kernels_runtime.precision import compute_dtype


def named_param_groups(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> list[list[tuple[str, nn.Parameter]]]:
    """The optimizer's param groups as (name, parameter) lists, trainable ones only."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError("the optimizer holds parameters that are not in the model; build "
                             "it from model.parameters() of the model passed to parallelize")
        groups.append([(names[id(p)], p) for p in group["params"] if p.requires_grad])
    return groups


class ZeroOptimizer(BoostedOptimizer):
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        ctx: ParallelContext,
        *,
        zero_stage: int,
        precision: str,
        max_grad_norm: float | None = None,
        bucket_mb: float = 8.0,
    ) -> None:
        super().__init__(ctx, precision, max_grad_norm)
        check_elementwise(optimizer)
        self.stage = zero_stage
        self._grads_sharded = zero_stage >= 1
        self.dtype = compute_dtype(precision)
        self.dp, self.dp_rank = ctx.dp_size, ctx.dp_rank
        groups = named_param_groups(model, optimizer)
        model.to(ctx.device)
        self.buckets = build_buckets(groups, self.dp, int(bucket_mb * 2**20))  # still fp32
        self.masters = [self._make_master(b) for b in self.buckets]
        if self.dtype != torch.float32:
            for b in self.buckets:
                _cast_bucket(b, self.dtype)
            _cast_other_params(model, self.dtype)
        self._grad_store = [self._make_grad_store(b) for b in self.buckets]
        self.inner = rebuild_optimizer(
            optimizer, [[m for b, m in zip(self.buckets, self.masters) if b.group_index == g]
                        for g in range(len(groups))]
        )
        self._slot = {id(p): (b.index, off) for b in self.buckets
                      for p, off in zip(b.params, b.offsets)}
        self._ready = [0] * len(self.buckets)
        self._next_launch = 0
        self._pending: list[zero_comms.Finish] = []
        self._in_backward = False
        self._synced_since_step = False
        # how many bucket reductions started while backward was still running vs at its end
        self.overlap = {"during_backward": 0, "at_end": 0}
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._zero_grads()

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

    # ---- backward hooks ------------------------------------------------------------------
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
        return self.sync_grads or self.stage == 2

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
        if self.stage == 0:
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
        if self.stage == 1 and self.sync_grads:
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

    def _drain(self) -> None:
        pending, self._pending = self._pending, []
        for finish in pending:
            finish()
        self._next_launch = 0

    # ---- step hooks ----------------------------------------------------------------------
    def _finish_grad_sync(self) -> None:
        if self._next_launch or self._pending:
            self._drain()

    def _master_grads(self) -> list[torch.Tensor]:
        grads = []
        for b, master, store in zip(self.buckets, self.masters, self._grad_store):
            g = store if self.stage != 1 else store[slice(*b.shard_range(self.dp_rank))]
            master.grad = g if g.dtype == torch.float32 else g.float()
            grads.append(master.grad)
        return grads

    def _publish_params(self) -> None:
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

    def _zero_grads(self) -> None:
        self._synced_since_step = False
        for b, store in zip(self.buckets, self._grad_store):
            store.zero_()
            for p, off in zip(b.params, b.offsets):
                p.grad = store[off:off + p.numel()].view_as(p) if self.stage < 2 else None
        for m in self.masters:
            m.grad = None

    # ---- checkpoint surface ------------------------------------------------------------
    def _ranges(self, saving: bool) -> list[tuple[Bucket, torch.Tensor, int, int, int]]:
        """(bucket, master, start, end, master's flat offset) per bucket. Saving splits even
        replicated (stage 0) buckets by dp rank so ranks write in parallel."""
        out = []
        for b, master in zip(self.buckets, self.masters):
            s, e = b.shard_range(self.dp_rank)
            base = 0 if self.stage == 0 else s
            if not saving and self.stage == 0:
                s, e = 0, b.padded
            out.append((b, master, s, e, base))
        return out

    def _segments(self, b: Bucket, start: int, end: int) -> list[tuple[Segment, int]]:
        return [(Segment(b.names[i], tuple(b.params[i].shape), lo, hi), b.offsets[i] + lo)
                for i, lo, hi in b.segments(start, end)]

    def saved_segments(self) -> list[tuple[Segment, SegmentValues]]:
        out = []
        for b, master, s, e, base in self._ranges(saving=True):
            state = self.inner.state.get(master, {})
            for seg, flat in self._segments(b, s, e):
                lo, hi = flat - base, flat - base + seg.numel
                values = {"master": master[lo:hi].float()}
                values.update({k: v[lo:hi] for k, v in state.items()
                               if isinstance(v, torch.Tensor) and v.shape == master.shape})
                out.append((seg, values))
        return out

    def needed_segments(self) -> list[Segment]:
        return [seg for b, _, s, e, _ in self._ranges(saving=False)
                for seg, _ in self._segments(b, s, e)]

    def load_segments(self, fetch: Callable[[Segment], SegmentValues]) -> None:
        self.materialize_state()
        with torch.no_grad():
            for b, master, s, e, base in self._ranges(saving=False):
                state = self.inner.state[master]
                for seg, flat in self._segments(b, s, e):
                    lo, hi = flat - base, flat - base + seg.numel
                    values = fetch(seg)
                    master[lo:hi].copy_(values["master"])
                    for k, v in state.items():
                        if isinstance(v, torch.Tensor) and v.shape == master.shape:
                            v[lo:hi].copy_(values[k])
            self._publish_params()

    def memory_breakdown(self) -> dict[str, int]:
        params = tensor_bytes([b.flat_param for b in self.buckets])
        grads = tensor_bytes(self._grad_store)
        masters = [m for b, m in zip(self.buckets, self.masters)
                   if m.untyped_storage().data_ptr() != b.flat_param.untyped_storage().data_ptr()]
        states = tensor_bytes(optimizer_state_tensors(self.inner) + masters)
        return {"params": params, "grads": grads, "optimizer": states}


def _cast_other_params(model: nn.Module, dtype: torch.dtype) -> None:
    """Parameters outside the buckets (frozen ones) follow the compute dtype; buffers such as
    rotary frequencies stay in fp32, as under FSDP2's mixed precision."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def _cast_bucket(b: Bucket, dtype: torch.dtype) -> None:
    """Store the bucket's parameters in ``dtype``; the parameters stay views of it."""
    b.flat_param = b.flat_param.to(dtype)
    for p, off in zip(b.params, b.offsets):
        p.data = b.flat_param[off:off + p.numel()].view_as(p)

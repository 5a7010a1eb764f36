"""Gradients of chunks: filled parameter by parameter in backward, reduce-scattered chunk by
chunk into the ``grad`` shard, accumulated over micro-batches: the ``ChunkReducer`` that
``ChunkGradSync`` (``chunk_sync.py``) composes, given the chunk table and the backward in
progress (``chunk_table.py``) and what to do before and after a chunk's reduction.

Per chunk, a gradient buffer of the whole (padded) chunk is taken when its first parameter's
gradient arrives (each parameter's first gradient is copied in, so the buffer is never zero
filled first, only the parameters a backward did not reach are zeroed); the chunk's last one
starts its reduction (one in flight: buffers do not pile up). The first reduced shard of a step
*is* the ``grad`` payload (no second, zero-filled tensor to add it into); later micro-batches
add into it. Its squared norm is computed when asked for (``master_grads``) or before it leaves
for disk, once per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from kernels_runtime.memory.chunk_table import BackwardPass, ChunkTable
from kernels_runtime.memory.tiers import Payload, Tier


class ChunkReducer:
    """Gradient buffers, their reduce-scatter and the ``grad`` shards' squared norms (module
    docstring). ``before_reduce(i)``: chunk ``i``'s pending step runs first (it owns ``grad``);
    ``after_reduce(i)``: the chunk's buffer is reduced, its parameters may go."""

    def __init__(self, table: ChunkTable, backward: BackwardPass, *,
                 before_reduce: Callable[[int], None],
                 after_reduce: Callable[[int], None]) -> None:
        self.table, self.backward = table, backward
        self._before_reduce, self._after_reduce = before_reduce, after_reduce
        chunks = table.chunks
        self._chunk_of = {id(p): c.index for c in chunks for p in c.params}
        self._param_index = {id(p): n for c in chunks for n, p in enumerate(c.params)}
        self._grad_buf: dict[int, torch.Tensor] = {}
        self._unwritten: dict[int, set[int]] = {}  # of a buffer: parameters with no gradient yet
        self._ready = [0] * len(chunks)
        self._pending: list = []
        self._sumsq: list[torch.Tensor | None] = [None] * len(chunks)
        self._grad_chunk = {table.key(c.index, "grad"): c.index for c in chunks}
        self.overlap = {"during_backward": 0, "at_end": 0}

    def on_grad_ready(self, p: nn.Parameter) -> None:
        t = self.table
        i = self._chunk_of[id(p)]
        c = t.chunks[i]
        buf = self._grad_buf.get(i)
        if buf is None:  # each parameter's first gradient is copied in: no zero fill first
            t.placer.make_room(Tier.DEVICE, c.padded * 4)
            buf = self._grad_buf[i] = t.store.device_empty(c.padded, torch.float32)
            t.store.charge_working(buf.numel() * 4)  # (padded,)
            buf[c.numel:].zero_()  # the padding
            self._unwritten[i] = set(range(len(c.params)))
        n = self._param_index[id(p)]
        part = buf[c.offsets[n]:c.offsets[n] + p.grad.numel()]
        if n in self._unwritten[i]:
            self._unwritten[i].discard(n)
            part.copy_(p.grad.reshape(-1))
        else:
            part.add_(p.grad.reshape(-1))
        p.grad = None
        self._ready[i] += 1
        if self._ready[i] == len(c.params):
            self.reduce(i)
            self.overlap["during_backward"] += 1

    def reduce(self, i: int) -> None:
        """Reduce-scatter chunk ``i``'s gradient into its ``grad`` shard and release it."""
        t = self.table
        self._before_reduce(i)  # a chunk no forward gathered: its pending step owns ``grad``
        self.backward.reduced.add(i)
        c = t.chunks[i]
        buf = self._grad_buf.pop(i, None)
        if buf is None:
            t.placer.make_room(Tier.DEVICE, c.padded * 4)
            buf = t.store.device_zeros(c.padded, torch.float32)  # (padded,)
            t.store.charge_working(buf.numel() * 4)
        for n in self._unwritten.pop(i, ()):  # parameters this backward did not reach
            buf[c.offsets[n]:c.offsets[n] + math.prod(c.shapes[n])].zero_()
        if t.dp > 1:
            t.placer.make_room(Tier.DEVICE, c.shard_size * 4)
            t.store.charge_working(c.shard_size * 4)  # released once accumulated
            shard = t.store.device_empty(c.shard_size, torch.float32)
            op = t.ctx.comm.reduce_scatter_async(shard, buf, group=t.ctx.dp_group)
        else:
            shard, op = buf, None
        self.drain()  # at most one reduction in flight: gradient buffers do not pile up
        self._pending.append((i, buf, shard, op))
        self._after_reduce(i)

    def drain(self) -> None:
        """Wait for the reduction in flight and accumulate it (``GradSync.finish``)."""
        store, dp = self.table.store, self.table.dp
        pending, self._pending = self._pending, []
        for i, buf, shard, op in pending:
            if op is not None:
                op.wait()
            if dp > 1:
                shard.mul_(1.0 / dp)
                store.release_working(shard.numel() * 4)
                store.release_working(buf.numel() * 4)
                store.release_device_buffer(buf)  # reduced: nothing refers to it
            else:  # the buffer is the shard
                store.release_working(buf.numel() * 4)
            self._accumulate(i, shard)

    def _accumulate(self, i: int, shard: torch.Tensor) -> None:
        """Add a reduced shard into the chunk's ``grad``; the first one of a step becomes the
        ``grad`` payload itself (its bytes were a working buffer until now: no copy, no
        zero-filled allocation). Its squared norm is computed when asked (``master_grads``)
        or before it leaves memory for disk, once per step, not per micro-batch."""
        t = self.table
        grad = t.grad[i]
        if grad is None:
            grad = t.grad[i] = t.store.adopt(t.key(i, "grad"), shard, Tier.DEVICE)
            t.placer.register(grad)
            t.placer.home[grad.key] = t.grad_homes[i] if t.grad_homes else Tier.DEVICE
        else:
            t.placer.bring(grad, Tier.DEVICE)
            grad.handle.add_(shard)
        t.placer.touch(grad.key)
        self._sumsq[i] = None
        t.placer.settle(grad)

    def end_of_backward(self) -> None:
        """Reduce what this backward did not reach (its gradient counts as zero) and wait."""
        for i in range(len(self.table.chunks)):
            if i not in self.backward.reduced and not self.table.chunks[i].frozen:
                self.reduce(i)
                self.overlap["at_end"] += 1
        self.drain()
        self._ready = [0] * len(self.table.chunks)

    # ---- the gradients' squared norms -----------------------------------------------------
    def grad_sumsq(self, i: int) -> torch.Tensor:
        """The squared norm of chunk ``i``'s gradient shard (one pass, no temporary), computed
        once per step where the gradient is in memory; a gradient leaving for disk has it
        computed on its way out (``before_spill``)."""
        sq = self._sumsq[i]
        if sq is None:
            grad = self.table.grad[i]
            if grad.tier == Tier.DISK:  # spilled by someone other than the placement
                self.table.placer.bring(grad, Tier.HOST, reads_only=True)
            sq = self._sumsq[i] = torch.dot(grad.handle, grad.handle)
        return sq

    def before_spill(self, payload: Payload) -> None:
        """``Placer.before_spill``: a gradient's norm is taken before it leaves for disk."""
        i = self._grad_chunk.get(payload.key)
        if i is not None and self.table.grad[i] is payload and self._sumsq[i] is None:
            self.grad_sumsq(i)

    def forget_sumsq(self, i: int) -> None:
        """Chunk ``i``'s gradient is gone (stepped, or zeroed)."""
        self._sumsq[i] = None

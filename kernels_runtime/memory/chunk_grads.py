"""Gradients of chunks: filled parameter by parameter in backward, reduce-scattered chunk by
chunk into the ``grad`` shard, accumulated over micro-batches: the backward half of
``ChunkGradSync`` (``chunk_sync.py``, which sets the attributes used here).

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

import torch
from torch import nn

from kernels_runtime.memory.tiers import Tier


class ChunkGrads:
    """The gradient half of ``ChunkGradSync`` (module docstring)."""

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        i = self._chunk_of[id(p)]
        c = self.chunks[i]
        buf = self._grad_buf.get(i)
        if buf is None:  # each parameter's first gradient is copied in: no zero fill first
            self.placer.make_room(Tier.DEVICE, c.padded * 4)
            buf = self._grad_buf[i] = self.store.device_empty(c.padded, torch.float32)
            self.store.charge_working(buf.numel() * 4)  # (padded,)
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
            self._reduce(i)
            self.overlap["during_backward"] += 1

    def _reduce(self, i: int) -> None:
        """Reduce-scatter chunk ``i``'s gradient into its ``grad`` shard and release it."""
        self.step_deferred(i)  # a chunk no forward gathered: its pending step owns ``grad``
        self._reduced.add(i)
        c = self.chunks[i]
        buf = self._grad_buf.pop(i, None)
        if buf is None:
            self.placer.make_room(Tier.DEVICE, c.padded * 4)
            buf = self.store.device_zeros(c.padded, torch.float32)  # (padded,)
            self.store.charge_working(buf.numel() * 4)
        for n in self._unwritten.pop(i, ()):  # parameters this backward did not reach
            buf[c.offsets[n]:c.offsets[n] + math.prod(c.shapes[n])].zero_()
        if self.dp > 1:
            self.placer.make_room(Tier.DEVICE, c.shard_size * 4)
            self.store.charge_working(c.shard_size * 4)  # released once accumulated
            shard = self.store.device_empty(c.shard_size, torch.float32)
            op = self.ctx.comm.reduce_scatter_async(shard, buf, group=self.ctx.dp_group)
        else:
            shard, op = buf, None
        self._drain()  # at most one reduction in flight: gradient buffers do not pile up
        self._pending.append((i, buf, shard, op))
        self._held.discard(i)
        if not self._active[i]:
            self.release(i)
        self._frozen_after_reduce(i)  # its units' frozen weights may be done with

    def _drain(self) -> None:
        pending, self._pending = self._pending, []
        for i, buf, shard, op in pending:
            if op is not None:
                op.wait()
            if self.dp > 1:
                shard.mul_(1.0 / self.dp)
                self.store.release_working(shard.numel() * 4)
                self.store.release_working(buf.numel() * 4)
                self.store.release_device_buffer(buf)  # reduced: nothing refers to it
            else:  # the buffer is the shard
                self.store.release_working(buf.numel() * 4)
            self._accumulate(i, shard)

    def _accumulate(self, i: int, shard: torch.Tensor) -> None:
        """Add a reduced shard into the chunk's ``grad``; the first one of a step becomes the
        ``grad`` payload itself (its bytes were a working buffer until now: no copy, no
        zero-filled allocation). Its squared norm is computed when asked (``master_grads``)
        or before it leaves memory for disk, once per step, not per micro-batch."""
        grad = self.grad[i]
        if grad is None:
            grad = self.grad[i] = self.store.adopt(f"c{i}.grad", shard, Tier.DEVICE)
            self.placer.register(grad)
            self.placer.home[grad.key] = self.grad_homes[i] if self.grad_homes else Tier.DEVICE
        else:
            self.placer.bring(grad, Tier.DEVICE)
            grad.handle.add_(shard)
        self.placer.touch(grad.key)
        self._sumsq[i] = None
        self.placer.settle(grad)

    def _end_of_backward(self) -> None:
        for i in range(len(self.chunks)):
            if i not in self._reduced and not self.chunks[i].frozen:  # unused in this pass:
                # its gradient counts as zero
                self._reduce(i)
                self.overlap["at_end"] += 1
        self._drain()
        for i in list(self._held):
            self._held.discard(i)
            self.release(i)
        self._end_frozen_backward()
        self._in_backward = False
        self._fetched_for_backward.clear()
        self._reduced.clear()
        self._ready = [0] * len(self.chunks)

    def prepare_backward(self, sync: bool) -> None:
        """Every backward reduce-scatters (as ZeRO-2 does): micro-batches accumulate in the
        ``grad`` shard, so no full gradient outlives its chunk's backward."""

    def finish(self) -> None:
        self._drain()

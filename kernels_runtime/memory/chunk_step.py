"""The optimizer step over chunks, streamed: one chunk's gradient, master and states brought
together wherever its master lives, stepped, written back, before the next chunk's.

Why streamed: the whole fp32 state (16 bytes per parameter under Adam) never has to fit one
tier; a disk-resident chunk costs one chunk of host memory while it steps, and the next
chunk's reads are started (``prefetch``) before this one steps, so disk time overlaps the
arithmetic. The inner optimizer is the user's own class rebuilt over the flat master shards
(element-wise, so exact on them); each call steps the one master that has a gradient.

Gradient scaling (fp16 unscaling, clipping) needs only each chunk's squared norm, computed when
its gradient shard was last accumulated, so ``master_grads`` hands the boosted optimizer
one-element proxies and the factor it applies is carried to the chunk's step (``scale_grads``).

``ChunkStepper`` is an object ``ChunkGradSync`` (``chunk_sync.py``) composes and delegates its
``GradSync`` methods of the step to; it is given the chunk table (``chunk_table.py``), the
gradient reducer whose shards it steps (``chunk_grads.py``) and the activation reserve, and owns
the deferred steps (``deferred_step.py``).
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from kernels_runtime.memory.activation_reserve import ActivationReserve
from kernels_runtime.memory.chunk_grads import ChunkReducer
from kernels_runtime.memory.chunk_table import ChunkTable
from kernels_runtime.memory.deferred_step import DeferredSteps
from kernels_runtime.memory.tiers import Payload, Tier
from kernels_runtime.mesh.plan import AXES
from kernels_runtime.mesh.shards import flat_range_boxes
from kernels_runtime.optim import PARAM, GradShard, StatePiece
from kernels_runtime.optim.state import layout_replica


class ChunkStepper:
    """The optimizer step over chunks, their publication and their checkpoint pieces."""

    def __init__(self, table: ChunkTable, reducer: ChunkReducer,
                 activations: ActivationReserve) -> None:
        self.table, self.reducer, self.activations = table, reducer, activations
        self._scale: torch.Tensor | float | None = None
        self.last_step: dict = {}
        self._pinned: list[Payload] = []
        self.optimizer_seconds = 0.0  # in the inner optimizer's arithmetic, cumulative
        self.deferred = DeferredSteps(table, step_chunk=self._step_chunk,
                                      step_payloads=self._step_payloads)

    def micro_batch(self):  # noqa: ANN201 - a context manager
        """Measure what the micro-batch keeps for backward: the device reserve under ``auto``
        (``activation_reserve.py``)."""
        if self.table.placer.mode != "auto":
            return contextlib.nullcontext()
        return self.activations.micro_batch()

    # ---- gradients as the boosted optimizer sees them -------------------------------------
    def master_grads(self) -> list[GradShard]:
        t = self.table
        self.deferred.complete_step()
        self.reducer.drain()
        out = []
        for c in t.chunks:
            if t.grad[c.index] is None:
                continue
            sq = self.reducer.grad_sumsq(c.index)
            layout = t.layouts[c.names[0]]
            out.append(GradShard(sq.sqrt().reshape(1), layout.sharded | {"dp"},
                                 layout.replica[0] == 0))
        return out

    def scale_grads(self, shards: list[GradShard], factor: torch.Tensor | float) -> None:
        for s in shards:
            s.tensor.mul_(factor)
        self._scale = factor if self._scale is None else self._scale * factor

    def zero_grads(self) -> None:
        t = self.table
        for i, grad in enumerate(t.grad):
            if self.deferred.is_deferred(i):  # its pending step consumes it
                continue
            if grad is not None:
                t.placer.forget(grad)
                t.store.free(grad, recycle=True)
                t.grad[i] = None
            self.reducer.forget_sumsq(i)
        self._scale = None
        for m in t.master:
            m.handle.grad = None

    # ---- the step ------------------------------------------------------------------------
    def _step_tier(self, i: int) -> Tier:
        master, placer = self.table.master[i], self.table.placer
        where = placer.home[master.key] if placer.mode == "static" else master.tier
        return Tier.DEVICE if where == Tier.DEVICE else Tier.HOST

    def _step_payloads(self, i: int) -> list[Payload]:
        t = self.table
        found = [t.grad[i], t.master[i], *t.states[i].values()]
        return [p for p in found if p is not None]

    def optimizer_step(self, inner: torch.optim.Optimizer) -> None:
        self.step_chunks(inner)
        self.end_step()

    def step_chunks(self, inner: torch.optim.Optimizer) -> None:
        """Every chunk's step (or its deferral): ``optimizer_step`` without ``end_step``,
        for a table sharing its store and placer with another (``expert_chunks.py``)."""
        t, store = self.table, self.table.store
        self.deferred.complete_step()
        self.reducer.drain()
        self.unpin()
        store.cancel_uploads()  # device copies of parameters about to change
        order = [c.index for c in t.chunks if t.grad[c.index] is not None]
        later = [i for i in order if self.deferred.defers(i)]  # stepped at their next use
        # read-aheads for a use that did not come, but not those of the deferred steps to come
        store.drop_reads(keep=self.deferred.read_ahead_keys(later))
        now = [i for i in order if i not in later]
        for k, i in enumerate(now):
            if k + 1 < len(now):
                self.deferred.prefetch_step(now[k + 1])
            self._step_chunk(inner, i, self._scale)
        if later:
            self.deferred.defer(inner, later, self._scale)
        self._scale = None

    def end_step(self) -> None:
        """The step is over for the store: the trace recorded predicts the next one, the
        activation reserve and the step's figures (telemetry, ``last_step``) are taken and
        the store's counters start again."""
        t, store = self.table, self.table.store
        t.placer.end_step()
        self.activations.end_step()
        moved = {f"{a}->{b}": n for (a, b), n in store.moved.items()}
        t.ctx.telemetry.record_offload(self.tier_bytes(), moved, store.evictions,
                                       store.wait_seconds)
        self.last_step = {"moved": dict(store.moved), "evictions": store.evictions,
                          "wait_seconds": store.wait_seconds,
                          "device_peak": int(store.peak[Tier.DEVICE]),
                          "device_state_peak": int(store.state_peak[Tier.DEVICE]),
                          "activations": self.activations.last_peak,
                          "device_total_peak": int(store.total_peak)}
        store.reap()  # writes still in flight (at most write_behind_bytes) go on: the
        # next forward's first reads of them reuse their memory instead of the disk
        store.reset_step_counters()

    def _step_chunk(self, inner: torch.optim.Optimizer, i: int,
                    scale: torch.Tensor | float | None, keep_params: bool = False) -> None:
        """Step chunk ``i`` where its master lives, its gradient multiplied by ``scale`` first
        (the step's, or the one a deferred step recorded); ``keep_params``: the parameters
        just published stay where they are (a forward gathers them next)."""
        t, placer = self.table, self.table.placer
        where = self._step_tier(i)
        payloads = self._step_payloads(i)
        for p in payloads:
            placer.touch(p.key)
            placer.in_use.add(p.key)
        for p in payloads:
            placer.bring(p, where)
        grad, master = t.grad[i], t.master[i]
        g = grad.handle
        if scale is not None:
            g.mul_(scale.to(g.device) if isinstance(scale, torch.Tensor) else scale)
        master.handle.grad = g
        if not t.states[i]:  # room for the states this first step creates (Adam's two)
            placer.make_room(where, 2 * master.nbytes)
        start = time.perf_counter()
        inner.step()
        self.optimizer_seconds += time.perf_counter() - start
        master.handle.grad = None
        self._adopt_states(inner, i)
        self._publish(i, keep=keep_params)
        for p in [master, *t.states[i].values()]:
            placer.in_use.discard(p.key)
            placer.settle(p)
        placer.in_use.discard(grad.key)
        placer.forget(grad)
        t.store.free(grad, recycle=True)
        t.grad[i] = None
        self.reducer.forget_sumsq(i)

    def _adopt_states(self, inner: torch.optim.Optimizer, i: int) -> None:
        """The optimizer's per-element states of a master become payloads (first step)."""
        t = self.table
        master = t.master[i]
        if t.states[i]:
            return
        for name, value in inner.state.get(master.handle, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() and value.numel() == master.numel:
                payload = t.store.adopt(t.key(i, name), value, master.tier)
                t.placer.register(payload)
                t.placer.home[payload.key] = self._state_home(master, payload.nbytes)
                t.states[i][name] = payload
        if t.placer.mode == "auto":
            t.placer.enforce()  # the new states may not fit where their master is

    def _state_home(self, master: Payload, nbytes: int) -> Tier:
        """A state lives with its master, but under static placement a host state takes what
        is left of ``host_mem`` like the payloads placed before it, else goes to disk."""
        home = self.table.placer.home[master.key]
        left = self.table.host_left
        if home != Tier.HOST or left is None:
            return home
        if left[0] >= nbytes:
            left[0] -= nbytes
            return Tier.HOST
        return Tier.DISK

    def _publish(self, i: int, keep: bool = False) -> None:
        """Updated master -> the parameters: the whole chunk all-gathered from every rank's
        shard (zero 2), or this rank's shard copied (zero 3 in 16 bit). ``keep``: the
        parameters stay where they were published (used next) instead of going home."""
        t, placer = self.table, self.table.placer
        param, master = t.param[i], t.master[i]
        if param is master:
            return
        was_in_use = master.key in placer.in_use
        placer.in_use.update((param.key, master.key))
        if master.tier == Tier.DISK:
            placer.bring(master, Tier.HOST, reads_only=True)
        if t.is_whole(i):
            placer.bring(param, Tier.DEVICE, overwrites=True)
            # (padded/dp,); from pinned memory the copy to a GPU is queued, not waited for
            mine = master.handle.to(param.handle.device, t.dtype,
                                    non_blocking=master.handle.is_pinned())
            if t.dp > 1:
                t.ctx.comm.all_gather(param.handle, mine, group=t.ctx.dp_group)
            else:
                param.handle.copy_(mine)
        else:
            placer.bring(param, Tier.DEVICE if master.tier == Tier.DEVICE else Tier.HOST,
                         overwrites=True)
            param.handle.copy_(master.handle)
        placer.in_use.discard(param.key)
        if not was_in_use:
            placer.in_use.discard(master.key)
            placer.settle(master)
        if not keep:
            placer.settle(param)

    def publish(self) -> None:
        self.deferred.complete_step()
        for c in self.table.chunks:
            self._publish(c.index)

    def materialize_state(self, inner: torch.optim.Optimizer) -> None:
        """Create the optimizer's states of every chunk without changing anything (a step with
        zero gradients at learning rate 0), so loading has tensors to fill."""
        t, placer = self.table, self.table.placer
        self.deferred.complete_step()
        if all(t.states[c.index] for c in t.chunks if not c.frozen):
            return
        self.unpin()
        lrs = [g["lr"] for g in inner.param_groups]
        for g in inner.param_groups:
            g["lr"] = 0.0
        for c in t.chunks:
            if c.frozen:
                continue
            master, where = t.master[c.index], self._step_tier(c.index)
            placer.in_use.add(master.key)
            placer.bring(master, where)
            placer.make_room(where, 2 * master.nbytes)
            master.handle.grad = torch.zeros_like(master.handle)
            inner.step()
            master.handle.grad = None
            self._adopt_states(inner, c.index)
            placer.in_use.discard(master.key)
            for p in [master, *t.states[c.index].values()]:
                placer.settle(p)
        for g, lr in zip(inner.param_groups, lrs):
            g["lr"] = lr

    # ---- model state ---------------------------------------------------------------------
    def _range(self, i: int, saving: bool) -> tuple[int, int, int]:
        t = self.table
        c = t.chunks[i]
        start, end = c.shard_range(t.dp_rank)
        base = start
        if saving:
            layout = t.layouts[c.names[0]]
            sharded = layout.sharded | {"dp"}
            replicated = [a for a in AXES if a not in sharded]
            index, count = layout_replica(layout, t.ctx.coords,
                                          {a: t.ctx.size(a) for a in AXES}, replicated)
            span = end - start
            start, end = start + span * index // count, start + span * (index + 1) // count
        return start, end, base

    def pieces(self, saving: bool, optimizer: torch.optim.Optimizer | None) -> list[StatePiece]:
        """Masters and states as pieces; disk-resident ones are read back into host memory
        first (they return to their tier at their next use)."""
        t = self.table
        self.deferred.complete_step()
        out = []
        for c in t.chunks:
            if c.frozen:  # not in a checkpoint: what trains is (the base has its own files)
                continue
            i = c.index
            for p in [t.master[i], *t.states[i].values()]:
                self._pinned.append(p)  # the views must stay live storage until the next use
                t.placer.in_use.add(p.key)
                if p.tier == Tier.DISK:
                    t.placer.place(p, Tier.HOST)  # over the budget until then
            states = {k: p.handle for k, p in t.states[i].items()} if optimizer else {}
            start, end, base = self._range(i, saving)
            for n, lo, hi in c.segments(start, end):
                name, layout = c.names[n], t.layouts[c.names[n]]
                for box, flat in flat_range_boxes(c.shapes[n], lo, hi):
                    at = c.offsets[n] + flat - base
                    for shard, where in layout.shards(name, box):

                        def view(t: torch.Tensor, at: int = at, sizes: tuple = box[1],
                                 where: tuple = where) -> torch.Tensor:
                            return t[at:at + math.prod(sizes)].view(sizes)[where]

                        values = {PARAM: view(t.master[i].handle),
                                  **{k: view(t) for k, t in states.items()}}
                        out.append(StatePiece(shard, values))
        return out

    def unpin(self) -> None:
        """Payloads ``pieces`` held in memory go back under the placement's rules."""
        placer = self.table.placer
        pinned, self._pinned = self._pinned, []
        for p in pinned:
            placer.in_use.discard(p.key)
        for p in pinned:
            placer.settle(p)
        if pinned and placer.mode == "auto":
            placer.enforce()

    def after_load(self) -> None:
        """The loaded values are in the pinned payloads (so their files are no copies any
        more): back under the budgets, then into the parameters."""
        for p in self._pinned:
            self.table.store.modified(p)
        self.unpin()
        self.publish()

    def memory_breakdown(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes of model state this rank holds on every tier together (``tier_bytes`` splits
        them by tier); ``params`` counts frozen weights too (in the compute dtype, this rank's
        shard under zero 3), as FSDP2's breakdown does."""
        t = self.table
        params = sum(p.nbytes for p in t.param)
        grads = sum(p.nbytes for p in t.grad if p is not None)
        masters = sum(m.nbytes for p, m in zip(t.param, t.master) if m is not p)
        states = sum(p.nbytes for s in t.states for p in s.values())
        return {"params": params, "grads": grads, "optimizer": masters + states}

    def tier_bytes(self) -> dict[str, int]:
        """Bytes of model state resident per tier now (device counts working buffers; the
        host's, disk reads ahead of their use, are state still on disk)."""
        store = self.table.store
        return {t.label: int(store.used[t] - (store.working[t] if t == Tier.HOST else 0))
                for t in Tier}

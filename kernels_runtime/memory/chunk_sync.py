"""ZeRO 2 and 3 on chunks whose parameters, gradients, masters and optimizer states live on any
tier: the ``GradSync`` of ``offload=static|auto``.

Per chunk (``chunks.py``) and rank, payloads (``tiers.py``):

| payload | zero 2 | zero 3 |
|---|---|---|
| ``param`` (compute dtype) | the whole chunk | this rank's shard |
| ``master`` (fp32 shard) | own tensor | the ``param`` itself in fp32 |
| ``grad`` (fp32 shard) | reduce-scattered each backward, kept until the step | same |
| optimizer states (shard) | created by the optimizer's first step | same |

Chunk states: *released* (parameters are empty tensors), *computing* (gathered on the device:
whole ``param`` brought there, or the shards all-gathered into a working buffer, and the
parameters views of it), *held* (gathered during backward until every gradient of the chunk
arrived), *reduced* (gradient reduce-scattered into ``grad``; released again). A unit's forward
pre-hook gathers its chunks and its forward hook releases them; a hook on the unit's outputs
gathers them again for its backward (a checkpointed block re-running its forward inside
backward keeps them); a gradient hook per parameter copies the gradient into the chunk's
buffer, and the chunk's last one starts the reduction (``chunk_grads.py``). The optimizer step
streams chunk by chunk (``chunk_step.py``), each wherever its master lives. Frozen parameters
(a LoRA base) are chunks of their own holding a ``param`` payload alone (``frozen_chunks.py``).

``ChunkGradSync`` owns the chunk layout, the payloads and the hooks, and gathers and releases
chunks; its parts are objects it composes, each given what it reads by its constructor: the
chunk table and the backward in progress (``chunk_table.py``), the gradient reducer
(``self.reducer``), the stepper (``self.stepper``, which owns the deferred steps,
``self.deferred``) and the frozen chunks' release (``self.frozen``). Its ``GradSync`` methods
of the step delegate to the stepper.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from kernels_runtime.deferred_params import materialize, move_real, to_be_loaded
from kernels_runtime.memory.activation_reserve import ActivationReserve
from kernels_runtime.memory.chunk_grads import ChunkReducer
from kernels_runtime.memory.chunk_placement import place_static, predicted_trace, set_floors
from kernels_runtime.memory.chunk_step import ChunkStepper
from kernels_runtime.memory.chunk_table import BackwardPass, ChunkTable
from kernels_runtime.memory.chunks import ChunkLayout, Unit, build_chunks, find_units
from kernels_runtime.memory.frozen_chunks import (
    FrozenRelease,
    frozen_named_params,
    in_backward,
    tensors_in,
)
from kernels_runtime.memory.host_malloc import payload_threshold, return_freed_memory
from kernels_runtime.memory.placement import Placer
from kernels_runtime.memory.tiers import Payload, Tier, TierStore
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.shards import ParamLayout
from kernels_runtime.optim import GradShard, GradSync, StatePiece
from kernels_runtime.parallel.data.zero import shard_over_dp


class ChunkGradSync(GradSync):
    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext,
        layouts: dict[str, ParamLayout], *, blocks: list[nn.Module], zero_stage: int,
        precision: str, store: TierStore, placer_args: dict, chunk_mb: float = 32.0,
        replaced: dict[int, nn.Parameter] | None = None, placer: Placer | None = None,
        activations: ActivationReserve | None = None, prefix: str = "",
    ) -> None:
        """``placer``, ``activations``: another sync's, whose ``store`` this one shares (one
        budget for two kinds of chunk, ``expert_chunks.py``); ``prefix`` keeps this sync's
        payload keys apart from that one's."""
        if placer is not None and placer.store is not store:
            raise ValueError("a shared placer places the payloads of its own store: pass "
                             "store=placer.store")
        shards = shard_over_dp(model, optimizer, ctx, layouts, zero_stage, precision, replaced)
        self.ctx, self.stage, self.dtype = ctx, shards.stage, shards.dtype
        self.dp, self.dp_rank, self.layouts = shards.dp, shards.dp_rank, shards.layouts
        groups = shards.groups
        self.training = optimizer is not None  # without: weights only, for inference
        self._groups = len(groups)
        # frozen parameters train nothing: weights-only chunks, a group after the optimizer's
        frozen = frozen_named_params(model, groups) if self.training else []
        for name, p in frozen:
            self.layouts[name] = layouts.get(name) or ParamLayout.replicated(tuple(p.shape))
        move_real(model, ctx.device)  # deferred parameters are materialized unit by unit
        self._model = model
        self._blocks = blocks
        self.units: list[Unit] = find_units(model, blocks)
        self.chunks: list[ChunkLayout] = build_chunks(
            self.units, blocks, [*groups, frozen], self.dp, int(chunk_mb * 2**20),
            key=lambda name: self.layouts[name].signature)
        for c in self.chunks:
            c.frozen = c.group == self._groups
        # before any payload exists: chunk-sized buffers leave the process when freed, smaller
        # temporaries (activations) are reused from the heap (host_malloc.py)
        return_freed_memory(payload_threshold(self._payload_sizes()))
        self.store = store
        self.placer = placer if placer is not None else Placer(
            store, predicted=predicted_trace(self.units, self.chunks, prefix), **placer_args)
        self.activations = activations if activations is not None \
            else ActivationReserve(self.placer, ctx.device)
        self.table = ChunkTable(ctx, self.stage, self.dtype, self.layouts, self.units,
                                self.chunks, store, self.placer, prefix=prefix)
        self.param, self.master = self.table.param, self.table.master  # (the same lists)
        self.grad, self.states = self.table.grad, self.table.states
        self._materialized: set[int] = set()
        for c in self.chunks:
            self._make_payloads(c)
        self._working: dict[int, Payload] = {}  # gathered buffers (zero 3, dp > 1)
        self._gathered: set[int] = set()
        self._in_backward = False
        self.backward = BackwardPass([0] * len(self.chunks))
        self.reducer = ChunkReducer(self.table, self.backward,
                                    before_reduce=self._before_reduce,
                                    after_reduce=self._after_reduce)
        self.overlap = self.reducer.overlap
        self.placer.before_spill = self.reducer.before_spill
        self.stepper = ChunkStepper(self.table, self.reducer, self.activations)
        self.deferred = self.stepper.deferred
        self.frozen = FrozenRelease(self.table, self.backward, self.release)
        self._install_hooks()
        self.frozen.install_hooks()
        set_floors(self.table, self.training)
        self.placer.check_budgets()

    # ---- construction --------------------------------------------------------------------
    def _make_payloads(self, c: ChunkLayout) -> None:
        if c.unit not in self._materialized and any(p.is_meta for p in c.params):
            self._materialize(c.unit)
        flat = c.flat_values(torch.float32, self.ctx.device)  # (padded,)
        shard = flat[slice(*c.shard_range(self.dp_rank))]  # (padded/dp,)
        values = shard if self.stage == 3 else flat
        key = self.table.key
        param = self.store.allocate(key(c.index, "param"), values.numel(), self.dtype,
                                    Tier.DEVICE)
        param.handle.copy_(values)
        param.viewed = True  # the parameters point into it while gathered
        if c.frozen or self._param_is_master():  # frozen: no master, the weights alone
            master = param
        else:
            master = self.store.allocate(key(c.index, "master"), shard.numel(),
                                         torch.float32, Tier.DEVICE)
            master.handle.copy_(shard)
            self.placer.register(master)
        self.placer.register(param)
        self.param.append(param)
        self.master.append(master)
        c.detach_params()

    def _payload_sizes(self) -> list[int]:
        """Bytes of each chunk's payloads to come: ``param`` (whole chunk, or this rank's
        shard under zero 3) and, for a trained chunk, its fp32 shards (master, gradient)."""
        item = self.dtype.itemsize
        sizes = [(c.padded if self.stage == 2 else c.shard_size) * item for c in self.chunks]
        if self.training:
            sizes += [c.shard_size * 4 for c in self.chunks if not c.frozen]
        return sizes

    def _param_is_master(self) -> bool:
        """One payload serves as parameters and fp32 master when they hold the same values:
        without an optimizer (the weights are all there is), and in fp32 when this rank's
        ``param`` is its shard (zero 3) or the shard is the whole chunk (one dp rank). Static
        placement keeps zero 2's two apart: its fractions place parameters and masters
        separately; automatic placement places what is used, and one copy is half the bytes
        with no copy after each step."""
        if not self.training:
            return True
        if self.dtype != torch.float32:
            return False
        return self.stage == 3 or (self.dp == 1 and self.placer.mode == "auto")

    def _materialize(self, u: int) -> None:
        """A deferred unit's parameters get storage and their initial values now; the chunks
        built before it already went to their tiers (``deferred_params.py``)."""
        if self.param and self.placer.mode == "auto":
            self.placer.enforce()  # the units built so far leave the room they must
        self._materialized.add(u)
        unit = self.units[u]
        blocks = {id(b) for b in self._blocks}
        modules = list(unit.module.modules()) if id(unit.module) in blocks else [unit.module]
        materialize(self._model, modules, self.ctx.device)
        if self.dp > 1 and not to_be_loaded(self._model):  # a loader fills every rank alike
            params = [p for m in modules for p in m.parameters(recurse=False)]
            src = dist.get_global_rank(self.ctx.dp_group, 0)
            pending = [self.ctx.comm.broadcast_async(p.data, src=src, group=self.ctx.dp_group)
                       for p in params]
            for op in pending:
                op.wait()

    def master_groups(self) -> list[list[torch.Tensor]]:
        return [[self.master[c.index].handle for c in self.chunks if c.group == g]
                for g in range(self._groups)]

    def place_homes(self, fractions: dict[str, float], host_budget: int | None) -> None:
        """Static placement (``chunk_placement.place_static``)."""
        place_static(self.table, fractions, host_budget)

    # ---- hooks ---------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        for u, unit in enumerate(self.units):
            if not unit.chunks:
                continue
            unit.module.register_forward_pre_hook(
                lambda m, args, u=u: self._before_forward(u))
            unit.module.register_forward_hook(
                lambda m, args, out, u=u: self._after_forward(u, out))
        for c in self.chunks:
            for p in [] if c.frozen else c.params:
                p.register_post_accumulate_grad_hook(self.reducer.on_grad_ready)

    def _before_forward(self, u: int) -> None:
        self.stepper.unpin()  # what ``pieces`` held for a checkpoint
        for i in self.units[u].chunks:
            self.backward.active[i] += 1
            self.gather(i)
        self._prefetch_unit(u + 1)

    def _prefetch_unit(self, u: int) -> None:
        """The parameters of the unit computed next start coming while this one computes:
        read back from disk on the disk store's threads, or copied from the host to the device
        on a side stream (a GPU; on the host the tiers are one memory)."""
        if 0 <= u < len(self.units):
            for i in self.units[u].chunks:
                param = self.param[i]
                if self.deferred.is_deferred(i) or i in self.backward.reduced \
                        or i in self._gathered:
                    continue  # published anew before its use, done with, or here already
                if param.tier == Tier.DISK:
                    self.placer.prefetch(param)
                else:
                    self.placer.prefetch_to_device(param)

    def _after_forward(self, u: int, output) -> None:
        for i in self.units[u].chunks:
            self.backward.active[i] -= 1
        if in_backward():  # a checkpointed block recomputing: its backward comes next
            return
        if torch.is_grad_enabled():
            outputs = tensors_in(output)
            for t in outputs:
                if t.grad_fn is not None:  # a node pre-hook runs after the tensor's hooks, so
                    # the next unit's frozen weights are released before these are gathered
                    t.grad_fn.register_prehook(lambda g, u=u: self._before_backward(u))
                elif t.requires_grad:
                    t.register_hook(lambda g, u=u: self._before_backward(u))
            self.activations.note_outputs(sum(t.numel() * t.element_size() for t in outputs))
        for i in self.units[u].chunks:
            if not self.backward.active[i] and i not in self.backward.held:
                self.release(i)

    def _before_backward(self, u: int) -> None:
        if not self._in_backward:
            self._in_backward = True
            Variable._execution_engine.queue_callback(self._end_of_backward)
        b = self.backward
        if u in b.fetched:
            return
        b.fetched.add(u)
        for i in self.units[u].chunks:
            if i not in b.reduced:
                self.gather(i)
                b.held.add(i)
        self.frozen.hold(u)
        self._prefetch_unit(u - 1)  # backward runs the units in reverse
        if 2 * u <= len(self.units):  # the disk idles in backward's second half: the next
            self.deferred.read_ahead()  # step's first deferred chunks start coming

    def _end_of_backward(self) -> None:
        self.reducer.end_of_backward()  # the chunks it did not reach too, and waits
        for i in list(self.backward.held):
            self.backward.held.discard(i)
            self.release(i)
        self.frozen.end_backward()
        self._in_backward = False
        self.backward.end()

    def _before_reduce(self, i: int) -> None:
        self.deferred.step_deferred(i)

    def _after_reduce(self, i: int) -> None:
        """Chunk ``i``'s gradients are all in: it is released unless a forward uses it, and
        its units' frozen weights may be done with."""
        self.backward.held.discard(i)
        if not self.backward.active[i]:
            self.release(i)
        self.frozen.after_reduce(i)

    # ---- gather and release --------------------------------------------------------------
    def gather(self, i: int) -> None:
        """Chunk ``i`` computing: its parameters views of a whole chunk on the device."""
        if i in self._gathered:
            return
        self.deferred.step_deferred(i, gathering=True)  # its last step, if pending, first
        self._gathered.add(i)
        c, param = self.chunks[i], self.param[i]
        self.placer.touch(param.key)
        self.placer.in_use.add(param.key)
        self.placer.bring(param, Tier.DEVICE, reads_only=True)
        if self.table.is_whole(i):
            c.point_params_at(param.handle)
            return
        self.placer.make_room(Tier.DEVICE, c.padded * param.handle.element_size())
        work = self.store.allocate(self.table.key(i, "whole"), c.padded, self.dtype, Tier.DEVICE,
                                   persistent=False)  # (padded,)
        self.ctx.comm.all_gather(work.handle, param.handle, group=self.ctx.dp_group)
        self._working[i] = work
        self.placer.in_use.discard(param.key)
        self.placer.settle(param)
        c.point_params_at(work.handle)

    def release(self, i: int) -> None:
        """Chunk ``i`` released: parameters empty, the gathered buffer freed, a whole
        ``param`` back to its home (static) or left for eviction (auto)."""
        if i not in self._gathered:
            return
        self._gathered.discard(i)
        self.chunks[i].detach_params()
        work = self._working.pop(i, None)
        if work is not None:
            self.store.free(work)
        param = self.param[i]
        self.placer.in_use.discard(param.key)
        self.placer.settle(param)



    # ---- GradSync: the step and its state, delegated to the stepper (``chunk_step.py``) ----
    @property
    def last_step(self) -> dict:
        return self.stepper.last_step

    @property
    def optimizer_seconds(self) -> float:
        return self.stepper.optimizer_seconds

    @property
    def deferred_steps(self) -> int:
        return self.deferred.deferred_steps

    @property
    def pending_steps(self) -> list[int]:
        """Chunks whose step of the last ``optimizer_step`` is still to run (deferred)."""
        return list(self.deferred.pending)

    def micro_batch(self):  # noqa: ANN201 - a context manager
        return self.stepper.micro_batch()

    def prepare_backward(self, sync: bool) -> None:
        """Every backward reduce-scatters (as ZeRO-2 does): micro-batches accumulate in the
        ``grad`` shard, so no full gradient outlives its chunk's backward."""

    def finish(self) -> None:
        self.reducer.drain()

    def complete_step(self) -> None:
        self.deferred.complete_step()

    def master_grads(self) -> list[GradShard]:
        return self.stepper.master_grads()

    def scale_grads(self, shards: list[GradShard], factor: torch.Tensor | float) -> None:
        self.stepper.scale_grads(shards, factor)

    def zero_grads(self) -> None:
        self.stepper.zero_grads()

    def optimizer_step(self, inner: torch.optim.Optimizer) -> None:
        self.stepper.optimizer_step(inner)

    def publish(self) -> None:
        self.stepper.publish()

    def materialize_state(self, inner: torch.optim.Optimizer) -> None:
        self.stepper.materialize_state(inner)

    def pieces(self, saving: bool, optimizer: torch.optim.Optimizer | None) -> list[StatePiece]:
        return self.stepper.pieces(saving, optimizer)

    def after_load(self) -> None:
        self.stepper.after_load()

    def memory_breakdown(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        return self.stepper.memory_breakdown(optimizer)

    def tier_bytes(self) -> dict[str, int]:
        return self.stepper.tier_bytes()

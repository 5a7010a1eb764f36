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
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from kernels_runtime.memory.activation_reserve import ActivationReserve
from kernels_runtime.memory.chunk_grads import ChunkGrads
from kernels_runtime.memory.chunk_step import ChunkStep
from kernels_runtime.memory.chunks import ChunkLayout, Unit, build_chunks, find_units
from kernels_runtime.memory.frozen_chunks import (
    FrozenRelease,
    frozen_named_params,
    in_backward,
    tensors_in,
)
from kernels_runtime.memory.placement import Placer, Trace, static_homes
from kernels_runtime.memory.tiers import Payload, Tier, TierStore
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.shards import ParamLayout
from kernels_runtime.parallel.data.zero import sharded_strategy
from kernels_runtime.policies.deferred import materialize, move_real, to_be_loaded


class ChunkGradSync(ChunkGrads, ChunkStep, FrozenRelease):
    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext,
        layouts: dict[str, ParamLayout], *, blocks: list[nn.Module], zero_stage: int,
        precision: str, store: TierStore, placer_args: dict, chunk_mb: float = 32.0,
        replaced: dict[int, nn.Parameter] | None = None,
    ) -> None:
        groups = sharded_strategy(self, model, optimizer, ctx, layouts, zero_stage, precision,
                                  replaced)
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
        self.store = store
        self.placer = Placer(store, predicted=self._predicted_trace(), **placer_args)
        self.activations = ActivationReserve(self.placer, ctx.device)
        self.param: list[Payload] = []
        self.master: list[Payload] = []
        self.grad: list[Payload | None] = [None] * len(self.chunks)
        self.states: list[dict[str, Payload]] = [{} for _ in self.chunks]
        self._chunk_of = {id(p): c.index for c in self.chunks for p in c.params}
        self._param_index = {id(p): n for c in self.chunks for n, p in enumerate(c.params)}
        self._materialized: set[int] = set()
        for c in self.chunks:
            self._make_payloads(c)
        self._working: dict[int, Payload] = {}  # gathered buffers (zero 3, dp > 1)
        self._active = [0] * len(self.chunks)  # units inside forward that need the chunk
        self._held: set[int] = set()  # gathered for backward, waiting for gradients
        self._grad_buf: dict[int, torch.Tensor] = {}
        self._unwritten: dict[int, set[int]] = {}  # of a buffer: parameters with no gradient yet
        self._ready = [0] * len(self.chunks)
        self._reduced: set[int] = set()
        self._pending: list = []
        self._in_backward = False
        self._fetched_for_backward: set[int] = set()
        self._sumsq: list[torch.Tensor | None] = [None] * len(self.chunks)
        self._grad_chunk = {f"c{c.index}.grad": c.index for c in self.chunks}
        self.placer.before_spill = self._before_spill
        self.overlap = {"during_backward": 0, "at_end": 0}
        self.grad_homes: list[Tier] | None = None  # static placement only
        self._gathered: set[int] = set()
        self._init_step()
        self._init_frozen()
        self._install_hooks()
        self._install_frozen_hooks()
        size = self.dtype.itemsize
        per_param = size + (4 if self.training else 0)
        self.placer.floor[Tier.DEVICE] = max(
            sum(self.chunks[i].padded * (size if self.chunks[i].frozen else per_param)
                for i in u.chunks)
            for u in self.units) if self.units else 0  # a unit's parameters and gradients
        per_shard = 4 * 4 if self.training else size  # grad, master, 2 states
        self.placer.floor[Tier.HOST] = max(  # a frozen chunk is evicted through the host
            (self.param[c.index].nbytes if c.frozen else c.shard_size * per_shard
             for c in self.chunks), default=0)
        self.placer.check_budgets()

    # ---- construction --------------------------------------------------------------------
    def _predicted_trace(self) -> Trace:
        keys = [f"c{i}.param" for u in self.units for i in u.chunks]
        for u in reversed(self.units):
            keys += [f"c{i}.{k}" for i in u.chunks for k in ("param", "grad")]
        for c in self.chunks:
            if not c.frozen:
                keys += [f"c{c.index}.{k}" for k in ("grad", "master", "state", "param")]
        return Trace(keys)

    def _make_payloads(self, c: ChunkLayout) -> None:
        if c.unit not in self._materialized and any(p.is_meta for p in c.params):
            self._materialize(c.unit)
        flat = c.flat_values(torch.float32, self.ctx.device)  # (padded,)
        shard = flat[slice(*c.shard_range(self.dp_rank))]  # (padded/dp,)
        values = shard if self.stage == 3 else flat
        param = self.store.allocate(f"c{c.index}.param", values.numel(), self.dtype, Tier.DEVICE)
        param.handle.copy_(values)
        param.viewed = True  # the parameters point into it while gathered
        if c.frozen or self._param_is_master():  # frozen: no master, the weights alone
            master = param
        else:
            master = self.store.allocate(f"c{c.index}.master", shard.numel(), torch.float32,
                                         Tier.DEVICE)
            master.handle.copy_(shard)
            self.placer.register(master)
        self.placer.register(param)
        self.param.append(param)
        self.master.append(master)
        c.detach_params()

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
        built before it already went to their tiers (``policies/deferred.py``)."""
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
        """Static placement (``placement.static_homes``): parameters, then frozen weights (the
        ``params`` share of their own bytes), then gradients, then masters and optimizer states
        take the host budget in that order. Under zero 3 in fp32 the master is the parameter
        shard: the larger of the two fractions applies."""
        host_left = [float("inf") if host_budget is None else float(host_budget)]
        trained = [c.index for c in self.chunks if not c.frozen]
        frozen = [c.index for c in self.chunks if c.frozen]
        aliased = bool(trained) and self.param[trained[0]] is self.master[trained[0]]
        share = fractions.get("params", 0.0)
        if aliased:
            share = max(share, fractions.get("optim", 0.0))
        homes = static_homes([self.param[i].nbytes for i in trained], share, host_left)
        homes += static_homes([self.param[i].nbytes for i in frozen],
                              fractions.get("params", 0.0), host_left)
        grad_homes = static_homes([self.chunks[i].shard_size * 4 for i in trained],
                                  fractions.get("grads", 0.0), host_left)
        self.grad_homes = [Tier.DEVICE] * len(self.chunks)  # frozen chunks have none
        for i, home in zip(trained, grad_homes):
            self.grad_homes[i] = home
        payloads = [self.param[i] for i in [*trained, *frozen]]
        if not aliased:
            homes += static_homes([self.master[i].nbytes for i in trained],
                                  fractions.get("optim", 0.0), host_left)
            payloads += [self.master[i] for i in trained]
        self.host_left = host_left  # what the optimizer's states may still take (first step)
        for payload, home in zip(payloads, homes):
            self.placer.home[payload.key] = home
            if payload.tier != home:
                self.placer.place(payload, home)
        self.store.reset_step_counters()

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
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _before_forward(self, u: int) -> None:
        if self._pinned:
            self.unpin()
        for i in self.units[u].chunks:
            self._active[i] += 1
            self.gather(i)
        self._prefetch_unit(u + 1)

    def _prefetch_unit(self, u: int) -> None:
        """The parameters of the unit computed next start coming while this one computes:
        read back from disk on the disk store's threads, or copied from the host to the device
        on a side stream (a GPU; on the host the tiers are one memory)."""
        if 0 <= u < len(self.units):
            for i in self.units[u].chunks:
                param = self.param[i]
                if self.is_deferred(i) or i in self._reduced or i in self._gathered:
                    continue  # published anew before its use, done with, or here already
                if param.tier == Tier.DISK:
                    self.placer.prefetch(param)
                else:
                    self.placer.prefetch_to_device(param)

    def _after_forward(self, u: int, output) -> None:
        for i in self.units[u].chunks:
            self._active[i] -= 1
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
            if not self._active[i] and i not in self._held:
                self.release(i)

    def _before_backward(self, u: int) -> None:
        if not self._in_backward:
            self._in_backward = True
            Variable._execution_engine.queue_callback(self._end_of_backward)
        if u in self._fetched_for_backward:
            return
        self._fetched_for_backward.add(u)
        for i in self.units[u].chunks:
            if i not in self._reduced:
                self.gather(i)
                self._held.add(i)
        self._hold_frozen(u)
        self._prefetch_unit(u - 1)  # backward runs the units in reverse

    # ---- gather and release --------------------------------------------------------------
    def gather(self, i: int) -> None:
        """Chunk ``i`` computing: its parameters views of a whole chunk on the device."""
        if i in self._gathered:
            return
        self.step_deferred(i, gathering=True)  # its last step, if still pending, first
        self._gathered.add(i)
        c, param = self.chunks[i], self.param[i]
        self.placer.touch(param.key)
        self.placer.in_use.add(param.key)
        self.placer.bring(param, Tier.DEVICE, reads_only=True)
        if self._is_whole(i):
            c.point_params_at(param.handle)
            return
        self.placer.make_room(Tier.DEVICE, c.padded * param.handle.element_size())
        work = self.store.allocate(f"c{i}.whole", c.padded, self.dtype, Tier.DEVICE,
                                   persistent=False)  # (padded,)
        self.ctx.comm.all_gather(work.handle, param.handle, group=self.ctx.dp_group)
        self._working[i] = work
        self.placer.in_use.discard(param.key)
        self.placer.settle(param)
        c.point_params_at(work.handle)

    def _is_whole(self, i: int) -> bool:
        """The ``param`` payload is the whole chunk (zero 2, or a single dp rank)."""
        return self.stage == 2 or self.dp == 1

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



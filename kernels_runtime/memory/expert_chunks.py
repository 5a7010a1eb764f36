"""Offload under expert parallelism: two chunk syncs, one per kind of parameter.

Under ep a rank holds every non-expert parameter (replicas over dp, which holds the ep ranks)
and E/ep of each block's experts (replicas over the expert-data-parallel group only,
``parallel/expert/grad_sync.py``). One ``ChunkGradSync`` lays out one data-parallel state, so,
as ``ExpertGradSync`` runs ZeRO twice, ``ExpertChunkSync`` runs the chunk sync twice:

- over the non-expert parameters on the plan's context (chunks padded to dp, reduce-scattered
  and all-gathered over dp);
- over the expert slices on the expert-data view of the context (``expert_data_context``: the
  edp group as its dp axis), with the expert layouts as that view sees them
  (``on_expert_data``), so ZeRO 2/3 shard the experts within their expert-data group.

Each sync finds the same units (``ParamView`` walks the whole model) but packs only its own
parameters, so a block's forward gathers its dense chunks and its expert chunks through two
sets of hooks, each sync's collectives on its own group in the same order on every rank. The
experts' backward already scales their gradients by 1/ep (``set_expert_grad_scale``), so the
expert-data average is the mean over dp that the dense chunks get. One inner optimizer (the
user's class over both syncs' masters) steps both, each sync stepping its own chunks. Under tp
both kinds hold tp shards (the experts' split over tp too) and chunk them by their layouts, as
the chunk sync does without ep.

Both syncs place their payloads through one tier store, one ``Placer`` and one activation
reserve (the dense sync's; the expert sync's payload keys carry the prefix ``e.``), because the
rank has one device and one host: ``device_mem`` and ``host_mem`` are budgets of the rank, not
of a kind. Under ``offload=auto`` a gathered expert chunk may evict a dense one and the other
way round, Belady's rule choosing over both kinds by one trace (the touches of both syncs in
the order they happen; before the first step, each unit's dense then expert chunks:
``chunk_placement.predicted_keys``). The floors a budget must hold count a unit's chunks of
both kinds (its forward gathers both), the reserve is measured once per micro-batch, and the
step's end (trace, reserve, telemetry, counters) runs once, after both syncs stepped. Static
shares apply to each kind's own chunks alike, so the sum is the plan's share; ``host_mem`` is
split between the two in proportion to their chunks' bytes (beyond it, disk). Refused
(``offload.check``): ``parallelize_model`` without an optimizer.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels_runtime.memory.chunk_placement import predicted_keys, set_floors
from kernels_runtime.memory.chunk_sync import ChunkGradSync
from kernels_runtime.memory.placement import Trace
from kernels_runtime.memory.tiers import Payload, TierStore
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.shards import ParamLayout
from kernels_runtime.optim import GradShard
from kernels_runtime.parallel.expert.grad_sync import ExpertSyncPair, ParamView

EXPERT_PREFIX = "e."  # of the expert sync's payload keys in the shared store and placer


class ExpertChunkSync(ExpertSyncPair):
    """``ChunkGradSync`` over dp for non-expert parameters and over expert-dp for experts
    (the pair's split and shared calls: ``ExpertSyncPair``)."""

    view = ParamView  # the chunks find their units by walking the whole module tree

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext,
        layouts: dict[str, ParamLayout], *, blocks: list[nn.Module], zero_stage: int,
        precision: str, store: TierStore, placer_args: dict, chunk_mb: float = 32.0,
        replaced: dict[int, nn.Parameter] | None = None,
    ) -> None:
        self.store = store
        self.settings = dict(blocks=blocks, zero_stage=zero_stage, precision=precision,
                             placer_args=placer_args, chunk_mb=chunk_mb)
        super().__init__(model, optimizer, ctx, layouts, replaced)
        if self.experts is not None:
            self._share_placement(self.dense, self.experts)
        # released parameters are empty: their shapes live here (experts on the plan's mesh)
        self.layouts = dict(self.dense.layouts)
        self.layouts.update({n: layouts[n] for n in self.expert_names if n in layouts})
        self.spill_folder = None
        self._dense_shards = 0  # how many of ``master_grads``' shards are the dense sync's

    def build(self, params: nn.Module, optimizer: torch.optim.Optimizer,
              ctx: ParallelContext, layouts: dict[str, ParamLayout],
              expert: bool) -> ChunkGradSync:
        """The dense sync makes the rank's placement; the expert sync places through it (one
        placer, one activation reserve, its payload keys prefixed)."""
        if not expert:
            sync = ChunkGradSync(params, optimizer, ctx, layouts, store=self.store,
                                 **self.settings)
            self.placer = sync.placer  # one placement for the rank
            return sync
        return ChunkGradSync(params, optimizer, ctx, layouts, store=self.store,
                             placer=self.placer, activations=self.dense.activations,
                             prefix=EXPERT_PREFIX, **self.settings)

    def _share_placement(self, dense: ChunkGradSync, experts: ChunkGradSync) -> None:
        """The placer both syncs use predicts, floors and spills for both (module docstring):
        each sync set it up for its own chunks alone."""
        self.placer.trace = Trace(predicted_keys([(dense.units, dense.chunks, ""),
                                                  (experts.units, experts.chunks,
                                                   EXPERT_PREFIX)]))
        set_floors(dense.table, dense.training, experts.table)
        self.placer.check_budgets()

        def before_spill(payload: Payload) -> None:  # a gradient's norm, whichever sync's
            dense.reducer.before_spill(payload)
            experts.reducer.before_spill(payload)

        self.placer.before_spill = before_spill

    # ---- placement -----------------------------------------------------------------------
    def place_homes(self, fractions: dict[str, float], host_budget: int | None) -> None:
        """The same static shares of each kind's own chunks; a host budget split between
        the two in proportion to their chunks' bytes (so together they keep within it)."""
        syncs = self.syncs()
        sizes = [sum(c.shard_size for c in s.chunks) for s in syncs]
        left = host_budget
        for k, (s, size) in enumerate(zip(syncs, sizes)):
            share = None
            if host_budget is not None:
                share = left if k == len(syncs) - 1 else host_budget * size // max(sum(sizes), 1)
                left -= share
            s.place_homes(fractions, share)

    def tier_bytes(self) -> dict[str, int]:
        """The rank's bytes per tier (the one store both syncs place in)."""
        return self.dense.tier_bytes()

    @property
    def last_step(self) -> dict:
        """The last step's figures of the rank (moved bytes, evictions, waits, peaks): the
        shared store's, taken once both syncs stepped."""
        return self.dense.last_step

    @property
    def optimizer_seconds(self) -> float:
        return sum(s.optimizer_seconds for s in self.syncs())

    @property
    def deferred_steps(self) -> int:
        return sum(s.deferred_steps for s in self.syncs())

    # ---- GradSync ------------------------------------------------------------------------
    def micro_batch(self):  # noqa: ANN201 - a context manager
        """The shared activation reserve measures the micro-batch once (``auto``)."""
        return self.dense.micro_batch()

    def complete_step(self) -> None:
        for s in self.syncs():
            s.complete_step()

    def master_grads(self) -> list[GradShard]:
        """Both syncs' per-chunk norm proxies. The expert ones are sharded over dp already
        (the stepper adds "dp" to every chunk's axes): ranks of an ep group hold different
        experts and those of an expert-data group different shards, so each counts once."""
        shards = self.dense.master_grads()
        self._dense_shards = len(shards)
        if self.experts is not None:
            shards += self.experts.master_grads()
        return shards

    def scale_grads(self, shards: list[GradShard], factor: torch.Tensor | float) -> None:
        """Each sync scales its own shards and carries the factor to its own chunks' step."""
        self.dense.scale_grads(shards[:self._dense_shards], factor)
        if self.experts is not None:
            self.experts.scale_grads(shards[self._dense_shards:], factor)

    def optimizer_step(self, inner: torch.optim.Optimizer) -> None:
        """Each sync steps its chunks with the one inner optimizer (only the master being
        stepped has a gradient), then the shared placement ends the step once (trace,
        reserve, telemetry: one record of the rank)."""
        for s in self.syncs():
            s.stepper.step_chunks(inner)
        self.dense.stepper.end_step()

    def materialize_state(self, inner: torch.optim.Optimizer) -> None:
        for s in self.syncs():
            s.materialize_state(inner)

    def after_load(self) -> None:
        for s in self.syncs():
            s.after_load()

    def memory_breakdown(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Both syncs' bytes (each counts its own payloads, states included)."""
        parts = [s.memory_breakdown(optimizer) for s in self.syncs()]
        return {k: sum(p[k] for p in parts) for k in parts[0]}

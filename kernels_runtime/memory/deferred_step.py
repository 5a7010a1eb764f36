"""A chunk whose optimizer step reads and writes the disk is stepped right before its next use.

Why: on the disk tier the step is disk-bound (a chunk's gradient, master and two Adam states
read, the master, states and parameters written: 8 bytes moved per byte of parameters), and
stepping every chunk in ``optimizer.step()`` leaves the disk idle through forward and backward
and the compute idle through the step. Deferred, chunk ``i``'s step runs when the next forward
gathers it (or anything else needs it), with the reads of the next chunks' inputs started
before (``WINDOW`` chunks ahead) and its writes behind, so the disk works while the units
before compute. The freshly published parameters go straight to that forward: they are not
written to disk and read back first.

The forward then carries most of the step's disk traffic (a chunk's four reads and four writes)
while the backward moves only parameters and gradients: measured on the bench's disk tier, the
disk was busy all forward long and mostly idle in backward. So the backward's second half
already reads the masters and optimizer states of the first chunks the next forward steps,
``WINDOW`` of the largest one's bytes (``read_ahead``: they do not change before that step,
and the step keeps those reads, ``drop_reads(keep=...)``), and the host buffers one window of
chunk steps keeps in flight are kept for reuse between steps (``TierStore.size_host_pool``)
rather than returned to the system and faulted in again (about 150 MiB a step on the bench).
The writes of a window of chunk steps may stay behind (``TierStore.widen_write_behind``, unless
set by hand): at the default 64 MiB, about one chunk step's writes, the compute thread waited
for writes whenever reads and writes shared the disk (40-50 ms a step on the bench).

What ``optimizer.step()`` promised still holds for anyone who looks: every path to a chunk's
parameters, gradient, master or states completes its pending step first (gathering for a
forward, a reduction of its gradient, ``pieces`` for checkpoints, publishing, a next step,
``GradSync.complete_step`` before the optimizer's scalar state is read), with the
hyperparameters (``lr`` ...) and the gradient scale (clipping, fp16) in force at the
``step()`` call, so a learning-rate schedule stepping in between changes nothing. Only static
placement defers, and only chunks whose step needs the disk: their placement does not depend
on the order of use, and everything else gains nothing from waiting.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

from kernels_runtime.memory.chunk_table import ChunkTable
from kernels_runtime.memory.tiers import Payload, Tier

WINDOW = 2  # chunks whose step inputs are being read ahead of the one stepped


StepChunk = Callable[[torch.optim.Optimizer, int, torch.Tensor | float | None, bool], None]


class DeferredSteps:
    """The pending chunk steps of the ``ChunkStepper`` that owns this (``chunk_step.py``):
    ``step_chunk(inner, i, scale, keep_params)`` steps chunk ``i``, ``step_payloads(i)`` are
    what that step reads (read ahead here)."""

    def __init__(self, table: ChunkTable, *, step_chunk: StepChunk,
                 step_payloads: Callable[[int], list[Payload]]) -> None:
        self.table = table
        self._step_chunk, self._step_payloads = step_chunk, step_payloads
        self._deferred: list[int] = []  # chunks whose step is pending, in chunk order
        self._deferred_inner: torch.optim.Optimizer | None = None
        self._deferred_groups: list[dict] = []  # hyperparameters at the step() call
        self._deferred_scale: torch.Tensor | float | None = None
        self.deferred_steps = 0  # chunk steps run deferred (cumulative)
        self.seconds = 0.0  # in the deferred chunk steps (cumulative; the bench's timeline)

    def defers(self, i: int) -> bool:
        """Chunk ``i``'s step waits for its next use (module docstring: static placement,
        and the step reads or writes the disk)."""
        t = self.table
        if t.placer.mode != "static":
            return False
        homes = [t.placer.home[t.master[i].key]]
        homes += [t.placer.home[p.key] for p in t.states[i].values()]
        if t.grad_homes:
            homes.append(t.grad_homes[i])
        return Tier.DISK in homes

    @property
    def pending(self) -> tuple[int, ...]:
        """The chunks whose step is pending, in chunk order."""
        return tuple(self._deferred)

    def is_deferred(self, i: int) -> bool:
        return i in self._deferred

    def defer(self, inner: torch.optim.Optimizer, chunks: list[int],
              scale: torch.Tensor | float | None) -> None:
        """Record the step of ``chunks`` as pending (nothing is read yet: between steps the
        host holds no more than its budget), with the gradient scale of this step."""
        self._deferred = list(chunks)
        self._deferred_inner = inner
        self._deferred_groups = [{k: v for k, v in g.items() if k != "params"}
                                 for g in inner.param_groups]
        if isinstance(scale, torch.Tensor):  # read once now, not once per chunk in a forward
            scale = scale.to("cpu")
        self._deferred_scale = scale
        t = self.table
        if chunks:  # writes behind a window of chunk steps, the buffers of a window and them
            per_chunk = max(sum(p.nbytes for p in self._step_payloads(i)) + t.param[i].nbytes
                            for i in chunks)
            t.store.widen_write_behind(WINDOW * per_chunk)
            t.store.size_host_pool((WINDOW + 1) * per_chunk + t.store.write_behind_bytes)

    def ahead(self) -> list[int]:
        """The chunks whose deferred step a next ``step()`` runs first: trained chunks whose
        step reads the disk, in chunk order, as many as hold ``WINDOW`` of the largest one's
        master and states (small chunks, embeddings and norms, count for their bytes)."""
        t = self.table
        chunks = [c.index for c in t.chunks if not c.frozen and self.defers(c.index)]
        sizes = [sum(p.nbytes for p in [t.master[i], *t.states[i].values()]) for i in chunks]
        budget, out = WINDOW * max(sizes, default=0), []
        for i, size in zip(chunks, sizes):
            if budget <= 0:
                break
            out.append(i)
            budget -= size
        return out

    def read_ahead(self) -> None:
        """Start reading the masters and optimizer states of the chunks a next step runs
        first (``ahead``), before that step (in backward, while the disk is otherwise idle;
        the gradients are still to come). Nothing while steps are pending."""
        if self._deferred:
            return
        t = self.table
        for i in self.ahead():
            for p in [t.master[i], *t.states[i].values()]:
                t.placer.prefetch(p)

    def read_ahead_keys(self, chunks: list[int]) -> set[str]:
        """Keys of the reads ``read_ahead`` started that a step deferring ``chunks`` uses."""
        t = self.table
        return {p.key for i in set(self.ahead()) & set(chunks)
                for p in [t.master[i], *t.states[i].values()]}

    def prefetch_step(self, i: int) -> None:
        """Start reading what chunk ``i``'s step reads."""
        for p in self._step_payloads(i):
            self.table.placer.prefetch(p)

    def step_deferred(self, upto: int | None = None, gathering: bool = False) -> None:
        """Run the pending chunk steps in order until chunk ``upto``'s is done (all of them
        for None); nothing when ``upto`` has none pending. ``gathering``: ``upto`` is gathered
        next, so its published parameters stay where they are."""
        if not self._deferred or (upto is not None and upto not in self._deferred):
            return
        inner = self._deferred_inner
        for i in self._deferred[:WINDOW]:
            self.prefetch_step(i)
        with self._hyperparameters(inner):
            while self._deferred:
                i = self._deferred.pop(0)
                if len(self._deferred) >= WINDOW:
                    self.prefetch_step(self._deferred[WINDOW - 1])
                start = time.perf_counter()
                self._step_chunk(inner, i, self._deferred_scale, gathering and i == upto)
                self.seconds += time.perf_counter() - start
                self.deferred_steps += 1
                if i == upto:
                    break
        if not self._deferred:
            self._deferred_inner, self._deferred_groups = None, []

    def complete_step(self) -> None:
        """Every pending chunk step, now (``GradSync.complete_step``)."""
        self.step_deferred(None)

    @contextlib.contextmanager
    def _hyperparameters(self, inner: torch.optim.Optimizer) -> Iterator[None]:
        now = [{k: g[k] for k in snap} for g, snap in zip(inner.param_groups,
                                                          self._deferred_groups)]
        for g, snap in zip(inner.param_groups, self._deferred_groups):
            g.update(snap)
        try:
            yield
        finally:
            for g, values in zip(inner.param_groups, now):
                g.update(values)

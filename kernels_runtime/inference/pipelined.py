"""Pipeline inference with micro-batches in flight on every stage.

Without overlap a step runs stage 0, then stage 1, ..., then samples, and only then schedules the
next: under pp=P every stage idles (P-1)/P of the time. Here the running sequences are split into
P groups (``micro_batches.py``: disjoint, so a group's next step never waits on another's
tokens), and each ``Engine.step()`` is one tick of a pipeline over them, as vLLM's virtual
engines and DeepSpeed's inference pipeline do. At tick t every rank of the replica

1. commits micro-batch t-P (the last stage sampled it at tick t-1 and sent its tokens to every
   other stage): its chunks' keys are in every stage's cache, its tokens are appended;
2. schedules micro-batch t from group t mod P and builds its batch;
3. runs its own stage's part of micro-batch t-s (stage s): stage 0 of the newest, the last stage
   of the oldest in flight, receiving the stage before's hidden states and sending its own on
   with ``irecv``/``isend`` posted when the batch is built, so no stage waits for a round trip.
   A later stage's micro-batch was scheduled at an earlier tick, so it runs first (before 1 and
   2): its tokens reach stage 0 without waiting for the bookkeeping.

So while stage 1 computes micro-batch A, stage 0 computes micro-batch B. The schedule is the same
on every rank (commit t-P, then schedule t), whatever its stage, so the schedulers stay
identical; a batch's copy-on-write, compaction and swap operations are applied on each stage
right before its part of that batch, in batch order. Each request samples with its own
generator, so greedy and seeded tokens are the plain engine's. ``Engine(pipeline_overlap=False)``
keeps the plain schedule. Speculation drafts for the scheduled group only (its sequences are the
only ones not in flight) and is settled at the commit, as ``Engine.step`` does after a forward.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kernels_runtime.inference.batch import StepBatch, build_batch
from kernels_runtime.inference.micro_batches import MicroBatchScheduler
from kernels_runtime.inference.params import RequestOutput
from kernels_runtime.inference.sampling import sample
from kernels_runtime.inference.scheduler import ScheduledStep, Scheduler
from kernels_runtime.inference.sequence import RUNNING
from kernels_runtime.inference.speculation import target_tokens


@dataclass
class _Flight:
    """One micro-batch from its schedule to its commit."""

    step: ScheduledStep
    batch: StepBatch | None  # None: the group had nothing to run
    hidden: Tensor | None = None  # (1, T, h) the stage before's, once received
    tokens: Tensor | None = None  # (R,) the last stage's tokens (other stages)
    logits: Tensor | None = None  # (R, V) the kept rows, when a request returns its logits
    result: tuple[list[int], list | None] | None = None  # the last stage's, after its part
    posted: list[Any] = field(default_factory=list)  # receives to wait for, in order
    sends: list[tuple[Any, Tensor]] = field(default_factory=list)  # (op, its buffer)

    @property
    def wants_logits(self) -> bool:
        return self.batch is not None and any(s.params.return_logits for s in self.batch.sampled)


@contextlib.contextmanager
def _scoped(speculation: Any, group: Scheduler) -> Iterator[tuple[Any, Scheduler]]:
    """The drafter looking at one group's running sequences (it drafts for its scheduler's)."""
    whole, speculation.scheduler = speculation.scheduler, group
    try:
        yield speculation, group
    finally:
        speculation.scheduler = whole


def overlap_steps(engine: Any, overlap: bool | None) -> PipelinedSteps | None:
    """The overlapped stepper for ``engine`` under pp > 1 (None: on under pp), or None for
    the plain one; it replaces the engine's scheduler with the grouped one."""
    if overlap is not None and not isinstance(overlap, bool):
        raise TypeError(f"pipeline_overlap must be True, False or None, got {overlap!r}")
    if engine.runner.pp == 1 or overlap is False:
        return None
    plain = engine.scheduler
    engine.scheduler = MicroBatchScheduler(plain.pool, plain.max_num_seqs,
                                           plain.max_batch_tokens, plain.preemption,
                                           engine.runner.pp)
    return PipelinedSteps(engine)


class PipelinedSteps:
    """``Engine.step()`` as one tick of the pipeline (module docstring)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.runner = engine, engine.runner
        ctx = engine.ctx
        self.depth, self.stage = self.runner.pp, self.runner.stage  # micro-batches in flight
        ranks = ctx.topology.group_of(ctx.rank, ("pp",))
        self.last, self.others = ranks[-1], ranks[:-1]
        self.comm, self.group = ctx.comm, ctx.group("pp")
        self.flights: deque[_Flight] = deque()
        self.tick = 0
        self.idle = 0  # ticks in a row with nothing in flight while requests wait

    @property
    def in_flight(self) -> int:
        """Micro-batches scheduled and not yet committed that run something."""
        return sum(f.batch is not None for f in self.flights)

    def sequences_in_flight(self) -> set:
        """Sequences whose micro-batch is not committed yet: their blocks are reserved (and
        their drafts appended) for tokens whose keys are not counted as computed yet."""
        return {seq for f in self.flights for seq, _ in f.step.chunks}

    def step(self) -> list[RequestOutput]:
        engine = self.engine
        changed, engine.rejected = engine.rejected, []
        if self.stage > 0 and self.tick >= self.stage:  # micro-batch tick - stage, scheduled
            self._compute(self.flights[-self.stage])  # before: run first, the next waits less
        if len(self.flights) == self.depth:
            changed += self._commit(self.flights.popleft())
        with _scoped(engine.speculation, engine.scheduler.groups[self.tick % self.depth]) \
                as (spec, group):
            spec.draft()  # this group's drafts only: the others' sequences are in flight
            step = group.schedule()
            spec.fit(step)
        self.flights.append(self._launch(step))
        if self.stage == 0:
            self._compute(self.flights[-1])
        self.tick += 1
        self._check_progress(step)
        engine.ctx.telemetry.record_inference(engine.stats())
        return changed

    def _check_progress(self, step: ScheduledStep) -> None:
        stuck = not self.in_flight and not step.preempted and self.engine.scheduler.has_work
        self.idle = self.idle + 1 if stuck else 0
        if self.idle > 2 * self.depth:
            raise RuntimeError("no micro-batch found anything to run while requests wait (a "
                               "bug: every admitted request fits the cache)")

    # ---- one micro-batch ------------------------------------------------------------------
    def _launch(self, step: ScheduledStep) -> _Flight:
        """Build the batch and post its receives: the stage before's hidden states and, off
        the last stage, the tokens (and kept logits) it will sample."""
        if not step.chunks:
            return _Flight(step, None)
        engine, runner = self.engine, self.runner
        flight = _Flight(step, build_batch(step.chunks, engine.block_size, engine.ctx.device))
        batch = flight.batch
        if runner.prev_rank is not None:
            flight.hidden = runner.incoming_buffer(batch.num_tokens)
            flight.posted.append(self.comm.irecv(flight.hidden, runner.prev_rank, self.group))
        if not runner.is_last:
            rows = sum(batch.rows)
            flight.tokens = torch.zeros(rows, dtype=torch.long, device=engine.ctx.device)
            flight.posted.append(self.comm.irecv(flight.tokens, self.last, self.group))
            if flight.wants_logits:
                flight.logits = torch.zeros(rows, engine.vocab, device=engine.ctx.device)
                flight.posted.append(self.comm.irecv(flight.logits, self.last, self.group))
        return flight

    def _compute(self, flight: _Flight) -> None:
        """This stage's part: the batch's cache operations, then its blocks; the hidden states
        sent on, or on the last stage the tokens sampled and sent to every other stage."""
        engine, runner = self.engine, self.runner
        engine._apply_cache_ops(flight.step)
        batch = flight.batch
        if batch is None:
            return
        if flight.hidden is not None:
            flight.posted.pop(0).wait()  # the hidden states' receive was posted first
        with engine.adapters.routing(batch.adapters):
            out = runner.stage_forward(batch, flight.hidden)
        if not runner.is_last:
            flight.sends.append((self.comm.isend(out, runner.next_rank, self.group), out))
            return
        drafts = sum(batch.rows) != len(batch.sampled)  # verified as in Engine._agree
        tokens = target_tokens(out, batch) if drafts else sample(out, batch.sampled)
        sent = torch.tensor(tokens, dtype=torch.long, device=engine.ctx.device)
        for rank in self.others:
            flight.sends.append((self.comm.isend(sent, rank, self.group), sent))
            if flight.wants_logits:
                flight.sends.append((self.comm.isend(out, rank, self.group), out))
        flight.result = tokens, [row.cpu() for row in out] if flight.wants_logits else None

    def _commit(self, flight: _Flight) -> list[RequestOutput]:
        """The micro-batch's tokens into its sequences (as ``Engine.step`` after a forward)."""
        for op, _ in flight.sends:
            op.wait()
        batch, engine = flight.batch, self.engine
        if batch is None:
            return []
        for op in flight.posted:
            op.wait()
        if flight.result is not None:
            tokens, rows = flight.result
        else:
            assert flight.tokens is not None
            tokens = flight.tokens.tolist()
            rows = [row.cpu() for row in flight.logits] if flight.logits is not None else None
        # a request aborted while its micro-batch was in flight has given its blocks back
        step = flight.step
        step.chunks = [(seq, n) for seq, n in step.chunks if seq.status == RUNNING]
        kept = [(seq, target, seq_rows) for seq, target, seq_rows in zip(
            batch.sampled, batch.per_sequence(tokens), batch.per_sequence(rows))
            if seq.status == RUNNING]
        changed, made = engine.commit(step, [k[0] for k in kept], [k[1] for k in kept],
                                      [k[2] for k in kept])
        engine.ctx.telemetry.tick(tokens=made)
        return changed

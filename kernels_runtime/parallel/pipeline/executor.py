"""Running a schedule on one pipeline rank: ``PipelineRunner`` is the ``train_step`` schedule of
a pipelined model.

``train_step(model, optimizer, microbatches)`` is the same call on every rank: each rank runs
its own actions of the schedule (``schedules.py``) on the micro-batches, in order. A forward
receives its input from the previous stage (the first stage reads the micro-batch itself),
runs the model's forward cut to the chunk (``stage.py``) and sends the output on; the last
stage's forward is the objective's loss. A backward receives the output's gradient from the
next stage (the last stage starts from its loss), runs autograd through the chunk and sends
the input's gradient back. Under ``zbv`` a backward computes the input gradient only and the
weight gradients wait for their ``W`` action (``weight_grad.py``).

Gradients stay local until every backward of the step is done: then a tied embedding's
gradient is summed over the first and last stage, and data parallelism reduces (the strategy's
``reduce_now``). The loss is summed over the pipeline so every rank returns it.

Each step leaves a timeline (which micro-batch each action ran, when, and how long the rank
waited on a receive before it) in ``last_timeline`` and in the telemetry, for the dashboard's
stage panel and ``bench pipeline``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from kernels_runtime.comm.accelerator import to_device
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.parallel.pipeline import weight_grad
from kernels_runtime.parallel.pipeline.p2p import StageLinks
from kernels_runtime.parallel.pipeline.schedules import Action, Schedule, build, forward_only
from kernels_runtime.parallel.pipeline.stage import StageBlocks, StageExit


def _signature(batch: Any) -> tuple:
    if isinstance(batch, torch.Tensor):
        return (tuple(batch.shape),)
    if isinstance(batch, dict):
        return tuple((k, *_signature(v)) for k, v in batch.items())
    if isinstance(batch, (tuple, list)):
        return tuple(s for v in batch for s in _signature(v))
    return ()


class PipelineRunner:
    def __init__(self, ctx: ParallelContext, blocks: StageBlocks, schedule_name: str,
                 chunks: int, tied: list[nn.Parameter]) -> None:
        self.ctx, self.blocks, self.name, self.chunks = ctx, blocks, schedule_name, chunks
        self.tied = tied  # parameters whose gradient is summed over the embedding group
        self.p, self.me = ctx.size("pp"), ctx.coord("pp")
        self.pp_ranks = ctx.topology.group_of(ctx.rank, ("pp",))
        self.headers: dict[tuple, tuple] = {}
        self._schedules: dict[int, Schedule] = {}
        self.last_timeline: dict[str, Any] = {}
        self.steps = 0  # steps completed (the same on every stage: each ends in a collective)
        self.costs: tuple[float, float, float] | None = None  # zbv: measured (F, B, W)
        self.deferred: weight_grad.DeferredGrads | None = None  # zbv: set by the applier

    def run(self, model: nn.Module, optimizer: Any, microbatches: Sequence[Any],
            objective: Any, telemetry: Any) -> torch.Tensor:
        """Every action of this rank for one step (see the module docstring); an error raised
        inside an action is noted with the stage, action and step it came from."""
        return self._guarded(model, optimizer, microbatches, objective, telemetry,
                             self.schedule_for(len(microbatches)))

    def evaluate(self, model: nn.Module, microbatches: Sequence[Any], objective: Any,
                 telemetry: Any) -> torch.Tensor:
        """The ``forward_only`` schedule without gradients: the summed loss (or whatever the
        objective returns on the last stage, a scalar) of every micro-batch, on every rank."""
        schedule = forward_only(self.p, len(microbatches), self.chunks,
                                v_shape=self.name == "zbv")
        with torch.no_grad():
            return self._guarded(model, None, microbatches, objective, telemetry, schedule)

    def _guarded(self, model: nn.Module, optimizer: Any, microbatches: Sequence[Any],
                 objective: Any, telemetry: Any, schedule: Schedule) -> torch.Tensor:
        self.current: tuple[Action, int] | None = None
        try:
            total = self._run(model, optimizer, microbatches, objective, telemetry, schedule)
        except Exception as err:
            if self.current is not None:
                action, stage = self.current
                err.add_note(f"[pipeline] raised on pipeline stage {stage} (rank "
                             f"{self.ctx.rank}, pp {self.me}/{self.p}) in {action.kind} of "
                             f"micro-batch {action.mb}, step {self.steps}")
            raise
        self.steps += optimizer is not None
        if self.name == "zbv" and self.costs is None and optimizer is not None:
            self._measure_costs()
        return total

    def _measure_costs(self) -> None:
        """After the first zbv step: the mean F, B and W time of a chunk action over all ranks
        (one all-reduce, so every rank derives the same order) shapes the order of later
        steps (``schedules.zero_bubble_v``)."""
        events = self.last_timeline.get("events", [])
        mean = []
        for kind in "FBW":
            times = [e["end"] - e["start"] - e["wait"] for e in events if e["kind"] == kind]
            mean.append(sum(times) / len(times) if times else 0.0)
        measured = torch.tensor(mean, dtype=torch.float64, device=self.ctx.device)
        # over every rank, not the pp group: the tp, sp and dp peers of a stage run their
        # collectives in schedule order, so all pipelines must derive the same order
        self.ctx.comm.all_reduce(measured, group=None)
        f, b, w = (max(v, 1e-9) for v in measured.tolist())
        self.costs = (1.0, round(b / f, 2), round(w / f, 2))  # rounded: the same on every rank
        self._schedules.clear()

    def schedule_for(self, m: int) -> Schedule:
        if m not in self._schedules:
            if self.name == "interleaved" and m % self.p:
                raise ValueError(f"pp_schedule=interleaved runs micro-batches in rounds of "
                                 f"pp={self.p}; pass a multiple of {self.p} (got {m})")
            self._schedules[m] = build(self.name, self.p, m, self.chunks, self.costs)
        return self._schedules[m]

    def _run(self, model: nn.Module, optimizer: Any, microbatches: Sequence[Any],
             objective: Any, telemetry: Any, schedule: Schedule) -> torch.Tensor:
        m = len(microbatches)
        place = schedule.placement
        device = self.ctx.device
        batches = [to_device(b, device) for b in microbatches]
        signatures = [_signature(b) for b in batches]
        links = StageLinks(self.ctx.comm, self.ctx.group("pp"), self.pp_ranks, self.me,
                           schedule, lambda i: signatures[i])
        last = place.stages - 1
        total = torch.zeros((), dtype=torch.float32, device=device)
        kept: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        deferred = self.deferred if schedule.split_backward else None
        if deferred is not None:
            deferred.ran = 0
        events: list[dict[str, Any]] = []
        start = time.perf_counter()
        training = optimizer is not None
        if training:
            optimizer.sync.prepare_backward(False)
        seeds = self.blocks.seeds
        forking = seeds.forking(device) if seeds is not None else contextlib.nullcontext()
        with optimizer.no_sync() if training else contextlib.nullcontext(), forking:
            for action in schedule.orders[self.me]:
                stage = place.stage(self.me, action.chunk)
                began = time.perf_counter()
                self.current = (action, stage)
                if action.kind == "F":
                    incoming = None if stage == 0 else links.recv(
                        ("act", stage, action.mb), place.owner(stage - 1)[0], self.headers,
                        device)
                    ready = time.perf_counter()
                    with telemetry.compute():
                        result = self._forward(model, objective, batches[action.mb], action,
                                               incoming, stage == last, deferred)
                    if training:
                        kept[(action.chunk, action.mb)] = (incoming, result)
                    if stage == last:
                        total += result.detach().float()
                    else:
                        links.send(("act", stage + 1, action.mb), place.owner(stage + 1)[0],
                                   result, self.headers)
                elif action.kind == "B":
                    incoming, output = kept.pop((action.chunk, action.mb))
                    grad = None if stage == last else links.recv(
                        ("grad", stage, action.mb), place.owner(stage + 1)[0], self.headers,
                        device)
                    ready = time.perf_counter()
                    with telemetry.compute():
                        self._backward(optimizer, output, grad, m, stage == last, action,
                                       deferred)
                    if stage > 0:
                        links.send(("grad", stage - 1, action.mb), place.owner(stage - 1)[0],
                                   incoming.grad, self.headers)
                else:
                    ready = time.perf_counter()
                    with telemetry.compute():
                        deferred.run(action.chunk, action.mb)
                done = time.perf_counter()
                events.append({"kind": action.kind, "chunk": action.chunk, "mb": action.mb,
                               "stage": stage, "start": began - start, "end": done - start,
                               "wait": ready - began})
            links.finish()
        if training:
            self._sum_tied()
            optimizer.sync.reduce_now()
        self.current = None
        self.ctx.comm.all_reduce(total, group=self.ctx.group("pp"))
        if deferred is not None and deferred.pending():
            raise RuntimeError(f"{deferred.pending()} weight gradients were never computed; "
                               "the zbv schedule lost a W action (a bug)")
        self._record(events, time.perf_counter() - start, links.bytes_sent, telemetry,
                     deferred.ran if deferred is not None else 0)
        return total

    def _forward(self, model: nn.Module, objective: Any, batch: Any, action: Action,
                 incoming: torch.Tensor | None, is_last: bool,
                 deferred: weight_grad.DeferredGrads | None) -> torch.Tensor:
        if incoming is not None and incoming.is_floating_point() and torch.is_grad_enabled():
            incoming.requires_grad_()
        context = deferred.recording(action.chunk, action.mb) if deferred is not None \
            else contextlib.nullcontext()
        seeds = self.blocks.seeds
        seeded = seeds.micro_batch(self.steps, action.mb) if seeds is not None \
            else contextlib.nullcontext()
        with self.blocks.running(action.chunk, incoming, exits=not is_last), context, seeded:
            try:
                loss = objective(model, batch)
            except StageExit as stop:
                return stop.output
        if not is_last:
            raise RuntimeError("the model's forward returned before its last block on this "
                               "pipeline stage; does the model skip blocks?")
        return loss

    def _backward(self, optimizer: Any, output: torch.Tensor, grad: torch.Tensor | None,
                  m: int, is_last: bool, action: Action,
                  deferred: weight_grad.DeferredGrads | None) -> None:
        context = deferred.deferring(action.chunk, action.mb) if deferred is not None \
            else contextlib.nullcontext()
        with context:
            if is_last:
                optimizer.backward(output / m)
            else:
                torch.autograd.backward(output, grad)

    def _sum_tied(self) -> None:
        if not self.tied:
            return
        group = self.ctx.group("embedding")
        for p in self.tied:
            if p.grad is not None:
                self.ctx.comm.all_reduce(p.grad, group=group)

    def _record(self, events: list[dict[str, Any]], seconds: float, nbytes: int,
                telemetry: Any, deferred: int) -> None:
        waited = sum(e["wait"] for e in events)
        self.last_timeline = {
            "schedule": self.name, "stage": self.me, "stages": self.p, "chunks": self.chunks,
            "microbatches": 1 + max((e["mb"] for e in events), default=-1),
            "step_seconds": seconds, "waited_seconds": waited,
            "bubble": waited / seconds if seconds > 0 else 0.0, "p2p_bytes": nbytes,
            "deferred_weight_grads": deferred,
            "events": events}
        record = getattr(telemetry, "record_pipeline", None)
        if record is not None:
            record(self.last_timeline)

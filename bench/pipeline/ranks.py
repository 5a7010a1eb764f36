"""The rank side of ``python -m bench pipeline``: one tiny HF GPT-2, pipelined two ways, timed
and measured on each of 2 gloo ranks (one thread each).

Ours: the unchanged model under "pp=2 mb=m pp_schedule=X" for gpipe, 1f1b, interleaved (2
chunks per rank) and zbv, trained by ``train_step``; every step's ``last_timeline`` is kept,
so the report can read what each stage waited on receives and what each action cost.
Theirs: ``torch.distributed.pipelining``'s ``PipelineStage`` built by hand from the same
blocks on the same split (``partition``, as our applier splits), run by ``ScheduleGPipe`` and
``Schedule1F1B`` with the same loss, the same tied-embedding gradient sum and the same SGD, so
the two sides do the same work per step. Peak activation memory is what autograd keeps saved
for backward at once (``kernels_runtime.calibrate.pipeline_memory.LiveSaved``), the quantity
a schedule's order changes.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kernels_runtime.calibrate.pipeline_memory import LiveSaved

OURS = ("gpipe", "1f1b", "interleaved", "zbv")
THEIRS = {"torch GPipe": "gpipe", "torch 1F1B": "1f1b"}  # torch's schedule -> ours it faces
PAIRS = (("1f1b", "torch 1F1B"), ("gpipe", "torch GPipe"), ("interleaved", "zbv"))  # timed together


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    vocab: int
    seq: int
    rows: int  # sequences per micro-batch
    microbatches: int
    pp: int = 2

    def describe(self) -> str:
        return (f"GPT-2 h={self.hidden}, {self.layers} layers, {self.heads} heads, vocab "
                f"{self.vocab}; {self.microbatches} micro-batches of {self.rows} x {self.seq} "
                f"tokens; pp={self.pp}")


def gpt2(shape: Shape) -> nn.Module:
    """The model, the same weights on every call. ``use_cache=False``: in training HF's GPT-2
    would otherwise fill a key/value cache, copying every layer's keys and values, which
    torch's stages (calling the blocks directly) do not: both sides must compute the same."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=shape.hidden, n_layer=shape.layers, n_head=shape.heads,
        vocab_size=shape.vocab, n_positions=shape.seq, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, use_cache=False, attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(config)


def token_batch(shape: Shape, step: int) -> torch.Tensor:
    """The step's (m * rows, seq) token ids, the same on every rank and for every variant."""
    return torch.randint(0, shape.vocab, (shape.microbatches * shape.rows, shape.seq),
                         generator=torch.Generator().manual_seed(step))


def plan_of(schedule: str, shape: Shape) -> str:
    chunks = " pp_chunks=2" if schedule == "interleaved" else ""
    return f"pp={shape.pp} mb={shape.microbatches} pp_schedule={schedule}{chunks}"


# ---- the variants -------------------------------------------------------------------------
class Ours:
    """Our pipelined GPT-2 under one schedule; ``step(s)`` trains on batch ``s`` and keeps the
    step's timeline."""

    def __init__(self, schedule: str, shape: Shape, comm: Any) -> None:
        from kernels_runtime import parallelize
        from kernels_runtime.mesh.context import ParallelContext

        self.shape = shape
        model = gpt2(shape)
        ctx = ParallelContext.build(plan_of(schedule, shape), comm)
        self.model, self.opt = parallelize(
            model, torch.optim.SGD(model.parameters(), lr=1e-3), ctx=ctx, verbose=False)
        self.runner = self.model.parallel_state.schedule
        self.timelines: dict[int, dict] = {}

    def step(self, s: int) -> float:
        from kernels_runtime import train_step

        began = time.perf_counter()
        ids = token_batch(self.shape, s)
        loss = train_step(self.model, self.opt, [(x, x) for x in ids.chunk(
            self.shape.microbatches)]).loss
        self.timelines[s] = {**self.runner.last_timeline, "wall": time.perf_counter() - began}
        return loss


class StageModule(nn.Module):
    """One pipeline stage of the GPT-2 as a plain module, as ``PipelineStage`` wants it: the
    embeddings on the first stage, the blocks of its range, the final norm and (tied) head on
    the last. HF's GPT-2 does the same sums; its sdpa attention is causal without a mask."""

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        t = model.transformer
        self.wte, self.wpe = (t.wte, t.wpe) if first else (None, None)
        self.h = nn.ModuleList(t.h[i] for i in blocks)
        self.ln_f, self.lm_head = (t.ln_f, model.lm_head) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:  # x: (b, s) token ids
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))[None]
        for block in self.h:
            x = block(x)  # (b, s, h)
        if self.lm_head is not None:
            x = self.lm_head(self.ln_f(x))  # (b, s, V)
        return x


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss: position t's logits against token t + 1, mean in fp32."""
    vocab = logits.shape[-1]
    return nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, vocab),
                                       ids[:, 1:].reshape(-1))


def split(model: nn.Module, stages: int) -> list[range]:
    """Our applier's split: the blocks balanced by parameter count."""
    from kernels_runtime.parallel.pipeline.partition import partition

    blocks = list(model.transformer.h)
    return partition([sum(p.numel() for p in b.parameters()) or 1 for b in blocks], stages)


class Theirs:
    """torch.distributed.pipelining on the same split: a hand-built ``PipelineStage`` per
    rank and its GPipe or 1F1B schedule over the same micro-batches."""

    def __init__(self, name: str, shape: Shape, rank: int) -> None:
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.shape, self.dist = shape, dist
        model = gpt2(shape)
        self.first, self.last = rank == 0, rank == shape.pp - 1
        self.module = StageModule(model, split(model, shape.pp)[rank], self.first, self.last)
        stage = PipelineStage(self.module, rank, shape.pp, torch.device("cpu"))
        kind = Schedule1F1B if name == "torch 1F1B" else ScheduleGPipe
        self.schedule = kind(stage, shape.microbatches, loss_fn=lm_loss)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=1e-3)
        self.tied = (self.module.wte if self.first else self.module.lm_head).weight
        self.steps: dict[int, dict] = {}  # step -> its wall seconds and actions' compute
        self._actions: list[tuple[str, float]] = []
        stage.forward_one_chunk = self._timed("F", stage.forward_one_chunk)
        stage.backward_one_chunk = self._timed("B", stage.backward_one_chunk)

    def _timed(self, kind: str, method: Callable) -> Callable:
        """The stage's own F or B computation, timed (its receives and sends are outside, and
        so is the last stage's loss, which ours counts in its F)."""
        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._actions.append((kind, time.perf_counter() - began))
        return timed

    def step(self, s: int) -> float:
        began = time.perf_counter()
        self._actions = []
        ids = token_batch(self.shape, s)
        losses: list[torch.Tensor] = []
        if self.first:
            self.schedule.step(ids)
        else:
            self.schedule.step(target=ids, losses=losses)
        self.dist.all_reduce(self.tied.grad)  # the tied embedding, as ours sums it (pp=2)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps[s] = {"wall": time.perf_counter() - began, "actions": self._actions}
        return sum(x.item() for x in losses) / len(losses) if losses else math.nan


# ---- the rank function --------------------------------------------------------------------
def _comm():
    from kernels_runtime.comm import Collectives

    return Collectives()


def run(rank: int, world: int, shape: Shape, rounds: int, steps: int,
        comm_for: Callable[[], Any] | None = None) -> dict:
    """Per variant on this rank: the first step's loss, the median step time of each round,
    peak saved bytes of one more step; for ours each round's bubble and the actions' costs,
    for torch's its F and B compute per step. Each pair (our 1f1b and torch's 1F1B, our
    gpipe and torch's GPipe, then interleaved and zbv) is timed on its own by
    ``time_variants``, a step of each per round, the order flipping from round to round: the
    two sides of a ratio run next to each other in time, so what else loads the machine
    weighs on both. ``comm_for()`` gives the rank's ``Collectives`` (default: a new one)."""
    from bench.common.timing import time_variants

    torch.set_num_threads(1)
    comm = (comm_for or _comm)()
    made: dict[str, Any] = {}
    for theirs, ours in THEIRS.items():
        made[ours] = Ours(ours, shape, comm)
        made[theirs] = Theirs(theirs, shape, rank)
    for name in OURS:
        if name not in made:
            made[name] = Ours(name, shape, comm)
    timed: dict[str, dict] = {"first_loss": {}, "times": {}}
    for pair in PAIRS:
        got = time_variants({name: made[name] for name in pair}, rounds, steps)
        for key, values in timed.items():
            values.update(got[key])
    peak = {}
    for name, variant in made.items():
        with LiveSaved() as meter:
            variant.step(2 + rounds * steps)
        peak[name] = meter.peak
    timed_steps = {name: [[v.timelines[s] if isinstance(v, Ours) else v.steps[s]
                           for s in range(2 + r * steps, 2 + (r + 1) * steps)]
                          for r in range(rounds)] for name, v in made.items()}
    return {"stage": rank, "first_loss": timed["first_loss"], "times": timed["times"],
            "peak": peak,
            "ours": {n: ours_summary(timed_steps[n]) for n in OURS},
            "theirs": {n: theirs_summary(timed_steps[n]) for n in THEIRS}}


def ours_summary(rounds: list[list[dict]]) -> dict:
    """Per round, medians over its steps of waited/step (the timeline's bubble) and idle/step
    (one minus the actions' compute over the step: the end-of-step wait too); medians of the
    compute and the wall time per step; and per (kind, virtual stage)
    the lower quartile of one action's compute over all timed steps: the per-micro-batch F,
    B (and W) times the replay projects with (a quartile, not the median: on cores others
    share, bursts of their load stretch many actions, never shorten one)."""
    costs: dict[tuple[str, int], list[float]] = {}
    for t in (t for steps in rounds for t in steps):
        for e in t["events"]:
            costs.setdefault((e["kind"], e["stage"]), []).append(_compute(e))
    last = rounds[-1][-1]
    return {"bubble": [statistics.median(t["bubble"] for t in steps) for steps in rounds],
            "idle": [statistics.median(1 - sum(_compute(e) for e in t["events"])
                                       / t["step_seconds"] for t in steps) for steps in rounds],
            "compute": statistics.median(sum(_compute(e) for e in t["events"])
                                         for steps in rounds for t in steps),
            "wall": statistics.median(t["wall"] for steps in rounds for t in steps),
            "costs": {key: _lower_quartile(v) for key, v in costs.items()},
            "deferred": last["deferred_weight_grads"], "p2p_bytes": last["p2p_bytes"]}


def theirs_summary(rounds: list[list[dict]]) -> dict:
    """torch's side in the same terms: the median F and B compute and wall time per step."""
    every = [t for steps in rounds for t in steps]
    return {"compute": statistics.median(sum(c for _, c in t["actions"]) for t in every),
            "wall": statistics.median(t["wall"] for t in every)}


def _lower_quartile(values: list[float]) -> float:
    return statistics.quantiles(values, n=4)[0] if len(values) > 1 else values[0]


def _compute(event: dict) -> float:
    return event["end"] - event["start"] - event["wait"]

"""Pipeline terms: the schedule's bubble, p2p between stages, the tied embedding, stage memory.

Under pp the step is no longer one rank's work: stage s cannot start micro-batch i before
stage s-1 has sent it, so ranks idle at the ends of the schedule (the bubble), and the first
stage keeps several micro-batches' activations alive at once. Both depend on the schedule's
exact order, so rather than closed forms this module replays the runtime's own schedules
(``kernels_runtime.parallel.pipeline.schedules.build`` and ``simulate.replay``, torch-free),
with each action costed from this cost model's own terms:

- F and B of virtual stage v (per micro-batch): the forward- and backward-phase seconds of
  ``ACTION_TERMS`` (matmuls, attention, memory-bound ops, recomputation and the exposed 1D
  tensor-parallel collectives) for that stage's blocks, plus the last stage's head and loss,
  plus the runtime's per-micro-batch and per-layer overhead (split 1:2, like the FLOPs).
  Stages are the runtime's split (equal blocks), so the head makes the last one longer and
  the replay shows what that costs. Under zbv, B and W each take half a backward
  (``split_costs``).
- p2p (Narayanan et al. 2021, arXiv 2104.04473): every micro-batch sends its (b, s, h)
  activation forward and its gradient back across each boundary between ranks, on the pp
  link (pp neighbours lie tp x sp ranks apart). Sends are asynchronous, so only their delay
  on the schedule's critical path costs time: the replay adds one transfer to every
  cross-rank dependency, and the difference to the replay without it is the exposed part.

With uniform stage costs the replay's bubble is exactly REFERENCES.md's (p-1)/(m+p-1) for
GPipe and 1F1B and (p-1)/(V*m+p-1) for interleaved with V chunks; zbv's is smaller (its weight
gradients fill the bubble). After the schedule a tied embedding's gradient is all-reduced
between the first and the last stage, and data parallelism reduces each stage's gradients
once (``timing.dp_comm``, exposed under pp); the step is the slowest rank's schedule end plus
that work (``run_schedule``).

Memory (``activations``): each rank keeps a micro-batch chunk's activations from its F to its
B (under zbv its W), so walking its action order gives the peak in flight: on the first stage
min(p, m) micro-batches under 1F1B, m under GPipe, (1 + (p-1)/(p*V)) times 1F1B's under
interleaved (Narayanan et al.), p stage-equivalents under zbv. Parameters per stage are the
stage's blocks plus the embeddings (first) and the head (last; a copy of a tied embedding):
``ModelSpec.stage_params_per_rank``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from kernels_runtime.mesh.plan import Plan, PlanError
from kernels_runtime.parallel.pipeline.schedules import Action, Schedule, build
from kernels_runtime.parallel.pipeline.simulate import Replay, replay, split_costs
from workbench.planner import parallel_comm, timing
from workbench.planner.activations import activation_bytes
from workbench.planner.setting import MemoryItem, Setting, TimeItem
from workbench.planner.timing import p2p_seconds, ring_seconds

ACTION_TERMS = (timing.compute, timing.elementwise, parallel_comm.tp_comm)


def check(plan: Plan) -> None:
    """What the runtime's pipeline applier refuses, in its words."""
    if plan.pp == 1:
        return
    if plan.sp > 1:
        raise PlanError(f"pp={plan.pp} with sp={plan.sp} ({plan.sp_mode}): sequence shards "
                        "between pipeline stages are not available yet; use pp with tp and dp, "
                        "or sp without pp")
    if plan.tp_mode != "1d":
        raise PlanError(f"pp={plan.pp} with tp_mode={plan.tp_mode}: grid-parallel stages are "
                        "not available yet; use tp_mode=1d with pipelines")


@lru_cache(maxsize=128)
def schedule_for(name: str, p: int, m: int, chunks: int) -> Schedule:
    """The runtime's schedule (built once per shape: zbv's list scheduling is not free)."""
    return build(name, p, m, chunks)


def _schedule(st: Setting) -> Schedule:
    return schedule_for(st.plan.pp_schedule, st.pp, st.microbatches, st.chunks)


# ---- time ---------------------------------------------------------------------------------
def stage_seconds(st: Setting) -> dict[int, tuple[float, float]]:
    """Virtual stage -> (forward, backward) seconds of one micro-batch on its rank."""
    out = {}
    m = st.microbatches
    for v in range(st.placement.stages):
        rank, chunk = st.placement.owner(v)
        one = replace(st, pp_rank=rank, chunk=chunk)
        items = [i for term in ACTION_TERMS for i in term(one)]
        micro = timing.micro_overhead(one)
        fwd = sum(i.seconds for i in items if i.phase == "forward") + micro / 3
        bwd = sum(i.seconds for i in items if i.phase == "backward") + 2 * micro / 3
        out[v] = (fwd / m, bwd / m)
    return out


def message_bytes(st: Setting) -> float:
    """One activation (or its gradient) sent across a boundary: this rank's (b, s, h) hidden
    states (sequence-split under split_gather) in the compute dtype."""
    return st.tokens_per_micro * st.spec.hidden * st.elem / (st.tp if st.sequence_parallel
                                                             else 1)


def link_seconds(st: Setting, a: int, b: int) -> float:
    """One message between pipeline ranks ``a`` and ``b``: pp neighbours lie tp x sp ranks
    apart, so a boundary is on NVLink inside a node and on the inter-node link across one."""
    hw, stride = st.hw, st.tp * st.sp
    if "p2p" in hw.collectives:
        link = hw.collectives["p2p"]
    else:
        same = a * stride // hw.devices_per_node == b * stride // hw.devices_per_node
        link = hw.intra_node if same else hw.inter_node
    return p2p_seconds(message_bytes(st), link.bandwidth, link.latency)


def transfer(st: Setting) -> float:
    """The transfer time the replay puts on every cross-rank dependency: the mean over the
    schedule's boundaries between ranks (its critical path crosses each of them alike, once
    filling and once draining the pipeline)."""
    place = st.placement
    times = [link_seconds(st, place.owner(v)[0], place.owner(v + 1)[0])
             for v in range(place.stages - 1) if place.owner(v)[0] != place.owner(v + 1)[0]]
    return sum(times) / len(times) if times else 0.0


@dataclass(frozen=True)
class ScheduleRun:
    """The schedule replayed with this plan's stage costs: per rank, its busy seconds and
    when its last action ends, without and with the p2p transfers on the critical path."""

    schedule: Schedule
    busy: tuple[float, ...]
    ends_alone: tuple[float, ...]  # p2p transfers free
    ends: tuple[float, ...]  # every cross-rank dependency one transfer later
    held: tuple[int, ...]  # peak micro-batch-chunk activations alive at once


def run_schedule(st: Setting) -> ScheduleRun:
    """Replay the plan's schedule with its stage costs (plans that differ only in what runs
    after the schedule, e.g. the ZeRO stage, share one replay)."""
    costs = stage_seconds(st)
    return replay_stages(st.plan.pp_schedule, st.pp, st.microbatches, st.chunks,
                         tuple(costs[v] for v in range(len(costs))), transfer(st))


@lru_cache(maxsize=512)
def replay_stages(name: str, p: int, m: int, chunks: int,
                  costs: tuple[tuple[float, float], ...], latency: float) -> ScheduleRun:
    """Replay schedule ``name`` with per-virtual-stage (forward, backward) seconds of one
    micro-batch, once without and once with ``latency`` on every cross-rank dependency."""
    schedule = schedule_for(name, p, m, chunks)
    place = schedule.placement

    def cost(rank: int, action: Action) -> float:
        fwd, bwd = costs[place.stage(rank, action.chunk)]
        return fwd if action.kind == "F" else bwd

    cost_fn = split_costs(cost, schedule)
    alone: Replay = replay(schedule, cost_fn)
    timed: Replay = replay(schedule, cost_fn, latency=latency)
    return ScheduleRun(schedule, tuple(alone.busy), tuple(_ends(alone)), tuple(_ends(timed)),
                       tuple(alone.peak_held))


def _ends(run: Replay) -> list[float]:
    return [spans[-1][2] if spans else 0.0 for spans in run.spans]


def bubble_items(st: Setting, run: ScheduleRun) -> list[TimeItem]:
    """This rank's idle time inside the schedule (kind "bubble"): the schedule's own, and the
    extra delay of p2p transfers on its critical path."""
    r = st.pp_rank
    idle = max(0.0, run.ends_alone[r] - run.busy[r])
    delay = max(0.0, run.ends[r] - run.ends_alone[r])
    name, m = st.plan.pp_schedule, st.microbatches
    return [TimeItem("pipeline bubble", "bubble", idle, note=(
                f"{name}, p={st.pp}, m={m}, {st.chunks} chunk(s) per rank: rank {r} idles "
                f"{idle / max(run.ends_alone[r], 1e-30):.1%} of its schedule")),
            TimeItem("pipeline p2p on the critical path", "bubble", delay, axis="pp",
                     note="transfers the schedule waits for (the rest overlap compute)")]


def pp_comm(st: Setting) -> list[TimeItem]:
    """This rank's p2p sends (window ``pipeline``: asynchronous, their exposed part is a bubble
    item) and, on the first and last stage when they are different ranks, the all-reduce of
    the tied embedding's gradient (exposed: it runs after the schedule)."""
    if st.pp == 1:
        return []
    place, m, me = st.placement, st.microbatches, st.pp_rank
    peers = [place.owner(u)[0] for v in st.virtual_stages for u in (v - 1, v + 1)
             if 0 <= u < place.stages]
    peers = [r for r in peers if r != me]  # activations forward, gradients back, m each
    sends = m * len(peers)
    seconds = m * sum(link_seconds(st, me, r) for r in peers)
    items = [TimeItem("pipeline p2p activations + gradients", "comm", seconds,
                      window="pipeline", axis="pp", count=sends,
                      nbytes=sends * message_bytes(st), note="p2p")] if sends else []
    first, last = place.owner(0)[0], place.owner(place.stages - 1)[0]
    if st.spec.tied_embeddings and first != last and st.pp_rank in (first, last):
        grad = -(-st.spec.vocab // st.tp) * st.spec.hidden * st.elem
        link = st.hw.link("all_reduce", 2, (last - first) * st.tp * st.sp)
        items.append(TimeItem("tied embedding gradient all-reduce", "comm",
                              ring_seconds("all_reduce", grad, 2, link.bandwidth, link.latency),
                              axis="embedding", nbytes=grad, note="all_reduce"))
    return items


# ---- memory -------------------------------------------------------------------------------
def activations(st: Setting) -> list[MemoryItem]:
    """Activations at this rank's peak in flight: each of its micro-batch chunks holds its
    blocks' activations (and the last stage the head's) from its F to its B (zbv: its W);
    under recomputation plus one block recomputed at a time."""
    if st.pp == 1:
        return []
    schedule = _schedule(st)
    ckpt = st.plan.activation_checkpointing

    def per_micro(layers: int) -> dict[str, float]:
        return activation_bytes(st.spec, st.micro_batch, st.elem, ckpt, st.tp, st.sp,
                                st.plan.sp_mode, layers=layers)

    transient = per_micro(0)["layers"]  # one block recomputed (0 without recomputation)
    weights = {}
    for c in range(st.chunks):
        one = replace(st, chunk=c)
        weights[c] = (per_micro(one.layers)["layers"] - transient,
                      per_micro(0)["head"] if one.has_head else 0.0)
    releases = "W" if schedule.split_backward else "B"
    held = [0.0, 0.0]
    best, count, at_best = (0.0, 0.0), 0, 0
    for a in schedule.orders[st.pp_rank]:
        sign = 1 if a.kind == "F" else -1 if a.kind == releases else 0
        held = [held[0] + sign * weights[a.chunk][0], held[1] + sign * weights[a.chunk][1]]
        count += sign
        if sum(held) > sum(best):
            best, at_best = (held[0], held[1]), count
    how = f"{at_best} micro-batch chunks in flight at the peak ({st.plan.pp_schedule}; stage " \
          f"rank {st.pp_rank}: {st.layers} blocks in {st.chunks} chunk(s))"
    if ckpt:
        how += ", layer inputs + one layer recomputed"
    items = [MemoryItem("activations", best[0] + transient, note=how)]
    if best[1]:
        items.append(MemoryItem("activations", best[1], note="norm, logits of the last stage"))
    return items


@dataclass(frozen=True)
class PipelineSummary:
    """What a pipelined prediction adds: which rank the memory and time are of, and the
    schedule's shape per rank."""

    schedule: str
    stages: int
    chunks: int
    microbatches: int
    memory_rank: int  # the rank with the largest device peak (its memory is the prediction's)
    time_rank: int  # the rank that finishes the step last (its time is the prediction's)
    blocks: tuple[int, ...]  # per rank
    held: tuple[int, ...]  # peak micro-batch chunks in flight per rank
    busy: tuple[float, ...]
    ends: tuple[float, ...]
    rank_peak: tuple[float, ...]  # device peak per rank
    rank_measurable: tuple[float, ...]  # model states + activations per rank

    @property
    def bubble_fraction(self) -> float:
        """The time rank's idle share of its schedule (p2p delays included)."""
        r = self.time_rank
        return 1 - self.busy[r] / self.ends[r] if self.ends[r] else 0.0

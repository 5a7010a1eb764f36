"""The planner's prediction reshaped for drawing: memory per rank, the step split, the front.

``predict`` answers for one rank: without a pipeline every rank holds the same share (ZeRO and
tensor parallelism split evenly), and under pp it is the stage with the largest peak. The
tuner draws every rank, so ``rank_memory`` re-runs the planner's own memory terms for each
pipeline stage (the stage's ``Setting``, as ``cost_model`` builds it) and places each rank on
its stage by the mesh's coordinates (``Topology``): the stage ``predict`` reports comes out
equal to its ``memory``, and every stage's device total to ``PipelineSummary.rank_peak``.

``step_split`` splits the predicted step time into parts that add up to ``step_time``:
compute, the exposed communication of each mesh axis, optimizer, overhead, the pipeline
bubble and offload I/O. ``Prediction.exposed_comm`` gives exposed seconds per overlap window;
within a window the exposed part is shared over axes in proportion to their seconds (the
collectives of a window hide behind the same compute, so none is preferred).

``pareto_front``: the candidates no other candidate beats on both step time and peak memory.
``budgets``: what each tier's bars are drawn against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from itertools import groupby

from kernels_runtime.mesh.topology import Topology
from workbench.planner.cost_model import Prediction, memory_items
from workbench.planner.setting import CATEGORIES, TIERS, MemoryItem

Memory = dict[str, dict[str, float]]  # tier -> category -> bytes


def by_tier(items: Sequence[MemoryItem]) -> Memory:
    """Bytes per tier and category of a list of memory items."""
    out = {tier: dict.fromkeys(CATEGORIES, 0.0) for tier in TIERS}
    for item in items:
        out[item.tier][item.category] += item.bytes
    return out


def stage_memory(p: Prediction) -> list[Memory]:
    """Memory per pipeline stage (one entry without pp), from the planner's memory terms."""
    if p.pipeline is None:
        return [by_tier(p.memory)]
    return [by_tier(memory_items(replace(p.setting, pp_rank=r)))
            for r in range(p.pipeline.stages)]


def rank_memory(p: Prediction) -> list[Memory]:
    """Memory of every rank of the plan's mesh (rank order), its stage's under pp."""
    stages = stage_memory(p)
    mesh = Topology.of(p.plan)
    return [stages[mesh.coords(r)["pp"]] for r in range(mesh.world)]


def exposed_by_axis(p: Prediction) -> dict[str, tuple[float, float]]:
    """(exposed, hidden) communication seconds per mesh axis; exposed sums to
    ``exposed_comm_time``."""
    exposed = p.exposed_comm()
    out: dict[str, tuple[float, float]] = {}
    for window, shown in exposed.items():
        key = None if window == "none" else window
        items = [t for t in p.time if t.kind == "comm" and t.window == key]
        total = sum(t.seconds for t in items)
        for t in items:
            share = shown * t.seconds / total if total else 0.0
            axis = t.axis or "other"
            e, h = out.get(axis, (0.0, 0.0))
            out[axis] = (e + share, h + t.seconds - share)
    return out


def step_split(p: Prediction) -> dict[str, float]:
    """Seconds of each part of the predicted step, in drawing order; the values add up to
    ``p.step_time``. Parts a plan does not have (a bubble without pp) are left out."""
    parts = {"compute": p.compute_time}
    parts.update({f"comm: {axis}": e for axis, (e, _) in exposed_by_axis(p).items()})
    parts.update({"optimizer": p.seconds("optimizer"), "overhead": p.seconds("overhead")})
    if p.pipeline is not None:
        parts["pipeline bubble"] = p.bubble_time
    if p.plan.offload != "none":
        parts["offload I/O"] = p.seconds("offload")
    return parts


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated (x, y) points, both to be minimised: no other point is
    at most as large in both and smaller in one. Equal points are all kept. Sorted by x."""
    order = sorted(range(len(points)), key=lambda i: points[i])
    front: list[int] = []
    best_y = float("inf")
    for _, group in groupby(order, key=lambda i: points[i][0]):
        same_x = list(group)  # sorted by y
        low = points[same_x[0]][1]
        if low < best_y:
            front += [j for j in same_x if points[j][1] == low]
            best_y = low
    return front


def budgets(p: Prediction, memory_budget: float | None = None) -> dict[str, float | None]:
    """Per-rank budget of each tier: the device budget given (else the hardware's memory),
    the plan's ``host_mem`` (else the hardware's host memory), the hardware's disk (None:
    unknown)."""
    hw = p.setting.hw
    device = memory_budget if memory_budget is not None else hw.device_memory
    host = p.plan.host_mem if p.plan.host_mem is not None else hw.host_memory
    return {"device": float(device), "host": float(host),
            "disk": float(hw.disk) if hw.disk else None}

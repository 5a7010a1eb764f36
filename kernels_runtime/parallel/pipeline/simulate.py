"""Replaying a schedule in time: does it finish, how long does each rank wait, what does it hold.

Every action starts when its rank is free and its input exists: a forward after the previous
virtual stage's forward of the same micro-batch, a backward after the next stage's backward
(the last stage's after its own forward), a weight step after its backward. Given the cost of
each action (unit costs, or the per-micro-batch forward and backward times a run measured),
``replay`` returns each action's start and end, each rank's idle time and the largest number
of micro-batch activations it kept alive. That is how tests prove a schedule deadlock-free on
any p without processes, and how ``bench pipeline`` projects bubbles for more stages than the
machine has cores. The bubble fraction is idle time over the step, per rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kernels_runtime.parallel.pipeline.schedules import Action, Schedule

Cost = Callable[[int, Action], float]  # (rank, action) -> seconds


@dataclass
class Replay:
    spans: list[list[tuple[Action, float, float]]]  # per rank: (action, start, end)
    makespan: float
    busy: list[float]
    peak_held: list[int]  # most micro-batch-chunk activations alive at once, per rank

    def bubble(self, rank: int | None = None) -> float:
        """Idle time over the step: one rank's, or the mean over ranks."""
        ranks = range(len(self.busy)) if rank is None else [rank]
        return sum(1 - self.busy[r] / self.makespan for r in ranks) / len(ranks)


def unit_costs(forward: float = 1.0, backward: float = 2.0) -> Cost:
    """F costs ``forward``; B ``backward`` (split into halves for B and W under zbv)."""

    def cost(rank: int, action: Action) -> float:
        return forward if action.kind == "F" else backward

    return cost


def split_costs(cost: Cost, schedule: Schedule) -> Cost:
    """Under a split backward B and W each take half of what a whole backward costs."""
    if not schedule.split_backward:
        return cost

    def halved(rank: int, action: Action) -> float:
        if action.kind == "F":
            return cost(rank, action)
        return cost(rank, Action("B", action.chunk, action.mb)) / 2

    return halved


def replay(schedule: Schedule, cost: Cost, latency: float = 0.0) -> Replay:
    """Run ``schedule`` in time; raises ValueError naming the stuck actions on a deadlock."""
    place, p = schedule.placement, len(schedule.orders)
    last = place.stages - 1
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    cursor = [0] * p
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    held, peak = [0] * p, [0] * p
    releases = "W" if schedule.split_backward else "B"
    total = sum(len(o) for o in schedule.orders)
    while sum(cursor) < total:
        progressed = False
        for r in range(p):
            if cursor[r] == len(schedule.orders[r]):
                continue
            action = schedule.orders[r][cursor[r]]
            stage = place.stage(r, action.chunk)
            dep = _dependency(action, stage, last)
            if dep is not None and dep not in done:
                continue
            arrival = 0.0 if dep is None else done[dep]
            if dep is not None and place.owner(dep[1])[0] != r:
                arrival += latency
            start = max(free[r], arrival)
            end = start + cost(r, action)
            done[(action.kind, stage, action.mb)] = end
            spans[r].append((action, start, end))
            free[r], cursor[r], progressed = end, cursor[r] + 1, True
            held[r] += action.kind == "F"
            held[r] -= action.kind == releases
            peak[r] = max(peak[r], held[r])
        if not progressed:
            stuck = [str(schedule.orders[r][cursor[r]]) for r in range(p)
                     if cursor[r] < len(schedule.orders[r])]
            raise ValueError(f"schedule {schedule.name} deadlocks: ranks wait at {stuck}")
    makespan = max(free)
    busy = [sum(e - s for _, s, e in rank) for rank in spans]
    return Replay(spans, makespan, busy, peak)


def _dependency(action: Action, stage: int, last: int) -> tuple[str, int, int] | None:
    if action.kind == "F":
        return None if stage == 0 else ("F", stage - 1, action.mb)
    if action.kind == "B":
        return ("F", stage, action.mb) if stage == last else ("B", stage + 1, action.mb)
    return ("B", stage, action.mb)


def bubble_formula(p: int, m: int, chunks: int = 1) -> float:
    """The bubble as a fraction of the step: (p-1)/(m+p-1) for GPipe and 1F1B; interleaved
    with V chunks shrinks the bubble time by V: (p-1)/(V*m + p-1) (REFERENCES.md)."""
    return (p - 1) / (chunks * m + p - 1)

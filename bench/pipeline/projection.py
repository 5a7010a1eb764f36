"""Bubbles without processes: every schedule replayed (``simulate.replay``) with unit costs,
where the formulas must come out exactly, and with the per-micro-batch F/B/W times measured at
pp=2, projected onto pp=4 splits the 2 cores cannot run for real.

The projection needs the cost of an action on a stage that was never measured (a pp=4 stage
holds half the blocks of a pp=2 one). gpipe, 1f1b and interleaved run the same F and whole B,
on stages of 4 and of 2 blocks, so each kind is fitted (least squares over the measured
(virtual stage, median time) pairs) as ``fixed + n * block + first * before + last * after``:
a per-action cost (the model's forward around the blocks, hooks, posting the send), n blocks
of equal cost, the embeddings on the first virtual stage and the final norm, head and loss on
the last. zbv's stages all hold 2 blocks, which cannot tell fixed from per-block cost, and its
forward records deferrable linears (so its F costs more), so its F, input-only B and W are
that fit's F and B scaled by factors measured on its own stages; its order is then list-
scheduled for those costs, as the runner reorders zbv once its first step has measured them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from kernels_runtime.parallel.pipeline.schedules import Action, Schedule, build
from kernels_runtime.parallel.pipeline.simulate import (
    Replay,
    bubble_formula,
    replay,
    split_costs,
    unit_costs,
)

CHUNKS = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zbv": 2}
BASE = {"F": "F", "B": "B", "W": "B"}  # what a zbv action is scaled from
Costs = dict[str, dict[tuple[str, int], float]]  # schedule -> (kind, virtual stage) -> seconds


@dataclass(frozen=True)
class Fit:
    coef: dict[str, tuple[float, ...]]  # kind -> (fixed, per block, first extra, last extra)
    zbv: dict[str, float]  # zbv's kind -> factor on the fitted F (F) or B (B, W)

    def seconds(self, schedule: str, kind: str, stage: int, stages: int, layers: int) -> float:
        terms = (1.0, layers / stages, float(stage == 0), float(stage == stages - 1))
        base = max(0.0, sum(c * t for c, t in zip(self.coef[BASE[kind]], terms)))
        return base * self.zbv[kind] if schedule == "zbv" else base


def schedule_of(name: str, p: int, m: int) -> Schedule:
    return build(name, p, m, CHUNKS[name])


def formula(name: str, p: int, m: int) -> float | None:
    """(p-1)/(m+p-1), interleaved (p-1)/(V*m+p-1); zbv has none (it aims below 1f1b's)."""
    return None if name == "zbv" else bubble_formula(p, m, CHUNKS[name])


def unit_replay(name: str, p: int, m: int) -> Replay:
    """F = 1, B = 2 per action (zbv's B and W a half each): the formulas' assumptions, equal
    stages and no communication time; a fraction does not depend on the unit."""
    schedule = schedule_of(name, p, m)
    return replay(schedule, split_costs(unit_costs(1.0, 2.0), schedule))


def fit_costs(costs: Costs, layers: int, p: int) -> Fit:
    """The fit of the module docstring, from each schedule's measured costs at ``p`` ranks."""
    rows: dict[str, list[tuple[list[float], float]]] = {}
    for name, measured in costs.items():
        if name == "zbv":
            continue
        stages = p * CHUNKS[name]
        for (kind, stage), seconds in measured.items():
            terms = [1.0, layers / stages, float(stage == 0), float(stage == stages - 1)]
            rows.setdefault(kind, []).append((terms, seconds))
    coef = {}
    for kind, pairs in rows.items():
        a = torch.tensor([t for t, _ in pairs], dtype=torch.float64)  # (points, 4)
        y = torch.tensor([[s] for _, s in pairs], dtype=torch.float64)  # (points, 1)
        coef[kind] = tuple(torch.linalg.lstsq(a, y, driver="gelsd").solution.flatten().tolist())
    plain = Fit(coef, {})
    stages = p * CHUNKS["zbv"]
    ratios: dict[str, list[float]] = {}
    for (kind, stage), seconds in costs.get("zbv", {}).items():
        ratios.setdefault(kind, []).append(
            seconds / plain.seconds("1f1b", BASE[kind], stage, stages, layers))
    return Fit(coef, {kind: statistics.median(r) for kind, r in ratios.items()})


def fit_residual(fit: Fit, costs: Costs, layers: int, p: int) -> float:
    """The largest relative gap between a measured action time and the fitted one."""
    return max(abs(fit.seconds(name, kind, stage, p * CHUNKS[name], layers) - seconds)
               / seconds for name, measured in costs.items()
               for (kind, stage), seconds in measured.items())


def projected_replay(name: str, fit: Fit, layers: int, p: int, m: int) -> Replay:
    """``name`` at ``p`` ranks, each action costing what the fit says its stage costs."""
    stages = p * CHUNKS[name]
    mean = [statistics.mean(fit.seconds(name, kind, v, stages, layers) for v in range(stages))
            for kind in "FBW"] if name == "zbv" else None
    # zbv orders its actions by their costs, as the runner does once it has measured them
    schedule = build(name, p, m, CHUNKS[name],
                     None if mean is None else tuple(round(c / mean[0], 2) for c in mean))
    place = schedule.placement

    def cost(rank: int, action: Action) -> float:
        return fit.seconds(name, action.kind, place.stage(rank, action.chunk), place.stages,
                           layers)

    return replay(schedule, cost)

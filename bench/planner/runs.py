"""The planner bench's three runs: does the recommended plan measure as fast as the best one?

One invocation interleaves the runs' rounds (round r belongs to run r % runs), so load from
other processes falls on every run alike, and each run is judged on its own rounds only: its
calibrations' median gives its profile, from which ``recommend`` ranks the plans again; its
step times are, per plan, the median over its rounds of the slowest rank's median step (beside
it the same comparison with each plan's fastest round: other processes' load only adds time,
but on a machine whose load swings by 10x within seconds the fastest round is an outlier as
often as the slowest, so the median decides). The recommended plan is the first of that
ranking that was measured (the bench measures the first calibration's top plans as well, so
this is almost always the first); the best is the fastest measured plan within the budget
(measured model states + activations + predicted buffers). Spread over runs is what one user
running the bench sees from run to run.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from bench.common.spread import span
from bench.common.table import print_table


@dataclass(frozen=True)
class RunVerdict:
    run: int
    recommended: str
    recommended_s: float
    rank: int  # position of ``recommended`` in the run's ranking (1: its first choice)
    best: str
    best_s: float
    fastest_ratio: float  # the same comparison with each plan's fastest round

    @property
    def ratio(self) -> float:
        return self.recommended_s / self.best_s


def step_times(per_rank: list[dict[str, Any]], rounds: list[int],
               over_rounds: Any = statistics.median) -> dict[str, float]:
    """Per plan: ``over_rounds`` (median, or min) of the slowest rank's median step in each of
    ``rounds`` (seconds)."""
    return {plan: over_rounds([max(r["times"][plan][i] for r in per_rank) for i in rounds])
            for plan in per_rank[0]["times"]}


def judge(per_rank: list[dict[str, Any]], runs: int, spec: Any, world: int, budget: float,
          fits: set[str]) -> list[RunVerdict]:
    """Each run's recommended plan against the best measured plan in ``fits`` (the measured
    plans within the budget)."""
    from workbench.planner import recommend
    from workbench.planner.cost_model import plan_label
    from workbench.planner.hardware import combine, from_measurements, median_records

    r0 = per_rank[0]
    total = len(r0["rounds"])
    verdicts = []
    for run in range(runs):
        rounds = [r for r in range(total) if r % runs == run]
        profile = from_measurements(median_records([combine(r0["rounds"][r]) for r in rounds]))
        steps, fastest = step_times(per_rank, rounds), step_times(per_rank, rounds, min)
        ranked = [plan_label(p.plan) for p in recommend(
            spec, world, budget, profile, precisions=("fp32", "bf16")).ranked]
        rank, chosen = next((i, p) for i, p in enumerate(ranked, 1) if p in steps)
        best = min((p for p in steps if p in fits), key=steps.__getitem__)
        fastest_best = min(fastest[p] for p in steps if p in fits)
        verdicts.append(RunVerdict(run + 1, chosen, steps[chosen], rank, best, steps[best],
                                   fastest[chosen] / fastest_best))
    return verdicts


def print_verdicts(verdicts: list[RunVerdict]) -> float:
    """The per-run table and the median ratio with its spread; returns the median ratio."""
    rows = [(v.run, v.recommended + ("" if v.rank == 1 else f" (its #{v.rank})"),
             v.recommended_s * 1e3, v.best, v.best_s * 1e3, v.ratio, v.fastest_ratio)
            for v in verdicts]
    print(f"\nrecommended vs best measured within budget, {len(verdicts)} runs (rounds "
          "interleaved; each run its own calibration, per plan the median of its rounds)")
    print_table(("run", "recommended", "meas ms", "best measured", "meas ms", "ratio",
                 "ratio, fastest rounds"), rows)
    ratios = [v.ratio for v in verdicts]
    median = statistics.median(ratios)
    fastest = [v.fastest_ratio for v in verdicts]
    print(f"ratio median {median:.2f}, spread {span(ratios)} over {len(ratios)} runs (with "
          f"fastest rounds: median {statistics.median(fastest):.2f}, spread {span(fastest)})")
    return median

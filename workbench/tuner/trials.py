"""Trials: a plan measured on the live pool beside what the cost model predicted for it.

A trial goes through ``execution.run_cell`` like any ``%%colossal`` cell, so it gets the same
care: dead ranks are reported, a failing rank interrupts the others, a broken process group is
re-created first, and a timeout interrupts every rank. The engines keep no trace of it but one
private name, removed at the end.

A tp or sp plan runs like any other: the trial gets the samples of one data-parallel replica
(``Setting.local_batch``), which its tp and sp ranks share, and the prediction it is compared
with carries the tp/sp terms. A pp plan trains with the pipeline: every stage of a replica
gets its micro-batches and runs the plan's schedule; stages hold different memory, so the
measured bytes are the largest stage's, as the prediction's are. A plan ``parallelize``
refuses fails on every rank; its first line (the runtime's own message) becomes the trial
row's error.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from workbench.cells.execution import run_cell
from workbench.planner.cost_model import Prediction, plan_label
from workbench.pool import rank_calls

RESULT_NAME = "_workbench_trial"


@dataclass
class Trial:
    """One row of the trials table. ``measured_*`` are None when the trial did not run."""

    plan: str
    hardware: str
    predicted_step_s: float
    predicted_bytes: float  # model states + activations kept for backward, per rank
    measured_step_s: float | None = None
    measured_bytes: float | None = None
    steps: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.measured_step_s is not None

    def time_error(self) -> float | None:
        """Relative error of the predicted step time (+ means over-predicted)."""
        if not self.ok:
            return None
        return self.predicted_step_s / self.measured_step_s - 1

    def memory_error(self) -> float | None:
        if not self.ok or not self.measured_bytes:
            return None
        return self.predicted_bytes / self.measured_bytes - 1


def trial_shape(prediction: Prediction) -> dict[str, Any]:
    """The model description a trial builds from: the spec the prediction used."""
    spec = asdict(prediction.setting.spec)
    return {k: v for k, v in spec.items() if v is not None}


def trial_code(prediction: Prediction, steps: int, warmup: int) -> str:
    """The cell the ranks run: one call, its result kept under a private name."""
    plan = prediction.plan.to_string()
    return (
        "from kernels_runtime.calibrate.trial import run_trial as _workbench_run_trial\n"
        f"{RESULT_NAME} = _workbench_run_trial({plan!r}, {trial_shape(prediction)!r}, "
        f"batch={prediction.setting.local_batch}, steps={steps}, warmup={warmup}, comm=comm)\n"
        "del _workbench_run_trial\n"
    )


def measure(pool: Any, prediction: Prediction, hardware: str, *, steps: int = 3,
            warmup: int = 1, timeout_s: float = 300.0) -> Trial:
    """Run the predicted plan on every rank of ``pool``; step time is the median over steps of
    the slowest rank, memory is rank 0's (ranks hold equal shares), under pp the largest
    stage's."""
    trial = Trial(plan_label(prediction.plan), hardware, prediction.step_time,
                  prediction.measurable_bytes, steps=steps)
    run_cell(pool, trial_code(prediction, steps, warmup), stream=lambda *_: None,
             display=lambda *_: None, timeout_s=timeout_s)
    view = pool.view()
    try:
        results = view.apply_async(rank_calls.pull_names, [RESULT_NAME]).get(timeout=30)
    finally:
        view.execute(f"globals().pop({RESULT_NAME!r}, None)", block=True)
    per_rank = [r[RESULT_NAME] for r in results]
    times = [max(r["step_s"][i] for r in per_rank) for i in range(steps)]
    trial.measured_step_s = statistics.median(times)
    totals = [float(m["params"] + m["grads"] + m["optimizer"] + m["activations"])
              for m in (r["memory"] for r in per_rank)]
    trial.measured_bytes = max(totals) if prediction.plan.pp > 1 else totals[0]
    return trial

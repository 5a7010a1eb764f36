"""Optional MLflow logging of a kept run: the very scalars its TensorBoard events hold.

Teams that track experiments in MLflow want a notebook's runs there, next to their scripts'
runs, without a second logging call in every cell. So ``keep_run`` (``runs.py``) can also log
each kept run to MLflow: a run named like the run directory (``<time>-<name>``), the plan, the
cell's magic line and the ranks as params, and every series of ``runs.scalars`` as a metric at
its training step (with the wall time of its point where it has one).

Off by default: importing mlflow costs seconds and a tracking server may be unreachable. On
with ``WORKBENCH_MLFLOW=1`` or ``keep_run(..., mlflow=True)``. MLflow itself picks where the
run goes (``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``, or its defaults); a run already
active in the calling thread becomes the parent. Logging never fails a cell: ``keep_run``
logs a warning instead, as for the run directory.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable
from typing import Any

from workbench.ui.dashboard.history import RunHistory

MLFLOW_ENV = "WORKBENCH_MLFLOW"
ON = ("1", "true", "yes", "on")
BATCH = 1000  # MLflow's limit of metrics per log_batch request


def mlflow_wanted(option: bool | None = None) -> bool:
    """Whether kept runs go to MLflow: ``option`` if given, else ``$WORKBENCH_MLFLOW``."""
    if option is not None:
        return bool(option)
    return os.environ.get(MLFLOW_ENV, "").strip().lower() in ON


def mlflow_missing() -> str | None:
    """Why MLflow logging cannot run (a message saying how to fix it), or None if it can."""
    if importlib.util.find_spec("mlflow") is None:
        return (f"MLflow logging was asked for ({MLFLOW_ENV}=1 or keep_run(mlflow=True)) but "
                "mlflow is not installed: `pip install mlflow-skinny` (or mlflow) in the "
                f"kernel's environment, or unset {MLFLOW_ENV}")
    return None


def log_run(history: RunHistory, name: str,
            scalars: Iterable[tuple[str, float, int, Any]]) -> str:
    """Log a finished cell's run to MLflow as run ``name``, with ``scalars`` (``runs.scalars``
    of it: (tag, value, step, wall time or None)) as metrics; its MLflow run id."""
    import mlflow
    from mlflow.entities import Metric, Param

    client = mlflow.MlflowClient()
    end_ms = int((history.wall_started + history.elapsed) * 1000)
    params = [Param("plan", history.plan or "(the pool default)"),
              Param("cell", history.label[:6000]),  # MLflow's limit on a param's value
              Param("ranks", ",".join(str(r) for r in history.ranks))]
    metrics = [Metric(tag, float(value), end_ms if wall is None else int(wall * 1000), step)
               for tag, value, step, wall in scalars]
    with mlflow.start_run(run_name=name, nested=mlflow.active_run() is not None) as run:
        run_id = run.info.run_id
        client.log_batch(run_id, params=params)
        for i in range(0, len(metrics), BATCH):
            client.log_batch(run_id, metrics=metrics[i:i + BATCH])
    return run_id

"""Kept runs logged to MLflow (``workbench/ui/dashboard/mlflow_log.py``), with the real
``mlflow`` (mlflow-skinny, the ``test`` extra) and a local file store under ``tmp_path``.

What is protected: with ``mlflow=True`` the kept run is also an MLflow run named like its run
directory, with the plan as a param and every scalar the run directory gets as a metric whose
history equals the published values exactly (doubles) at their steps; off by default (no
``WORKBENCH_MLFLOW``), nothing goes to MLflow.
"""

from __future__ import annotations

from test_runs_compare import LOSSES, _history

from workbench.ui.dashboard import runs
from workbench.ui.dashboard.mlflow_log import MLFLOW_ENV, mlflow_wanted


def test_a_kept_run_is_logged_to_mlflow_with_every_scalar(tmp_path, monkeypatch) -> None:
    import mlflow  # seconds to import: only where the test runs

    # a local file store: the quickest MLflow backend to start (a sqlite one migrates its
    # schema first), in maintenance mode since MLflow 3 hence the opt-in
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv(MLFLOW_ENV, raising=False)
    assert not mlflow_wanted()  # off by default
    history = _history("dp=2 zero=1", LOSSES, 100.0)
    assert runs.keep_run(history, tmp_path / "runs", background=False).mlflow_run_id is None

    kept = runs.keep_run(history, tmp_path / "runs", background=False, mlflow=True)
    path = kept.wait()
    client = mlflow.MlflowClient()
    run = client.get_run(kept.mlflow_run_id)
    assert run.info.run_name == path.name
    assert run.data.params["plan"] == "dp=2 zero=1"
    assert set(run.data.metrics) == {tag for tag, *_ in runs.scalars(history)}

    def read(key: str) -> tuple[list[int], list[float]]:
        rows = sorted(client.get_metric_history(kept.mlflow_run_id, key), key=lambda m: m.step)
        return [m.step for m in rows], [m.value for m in rows]

    steps = list(range(1, len(LOSSES) + 1))
    assert read("train/loss") == (steps, LOSSES)  # exact
    assert read("train/lr") == (steps, [0.1 / s for s in steps])
    assert read("eval/loss") == ([4], [LOSSES[3] * 1.1])

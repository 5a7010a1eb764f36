"""Runs kept: every ``%%colossal`` cell that trains gets a run directory with TensorBoard events.

A notebook is where plan A is tried and then plan B, so a run must outlive its cell and its
kernel. When a cell that ran ``train_step`` ends, ``keep_run`` writes ``<root>/<time>-<name>/``:

- TensorBoard event files (``torch.utils.tensorboard.SummaryWriter``; ``tensorboard --logdir
  runs`` reads them): a scalar for every series the dashboard draws. ``train/loss``,
  ``train/lr``, ``train/grad_norm``, ``train/loss_scale``, ``train/skipped_steps`` and
  ``eval/loss`` per training step; ``throughput/tokens_per_s/rank<r>``, ``comm/<axis>`` and
  ``p2p/<axis>`` (bytes, all ranks) at each polled point, at the training step it was taken;
  ``memory/<tier>/rank<r>``, ``memory_peak/<tier>/rank<r>`` and ``time/<part>/rank<r>`` at the
  last step. Scalars are written as doubles (``double_precision``), so the losses read back
  equal the ``StepResult.loss`` values the cell returned, exactly. The plan and the cell's
  magic line are written as text.
- ``run.json``: the label, plan, ranks, start time and the figures ``compare`` draws without
  reading events (tokens/s, peak memory per tier).

The root is ``root`` if given, else ``$WORKBENCH_RUNS_DIR``, else ``runs/`` under the
notebook's working directory; ``WORKBENCH_RUNS_DIR=off`` keeps nothing. Every kept run of the
session is also in ``SESSION_RUNS`` (newest last), which ``compare`` indexes. Writing never
fails a cell: an error is logged and the run is still kept in the session. With
``WORKBENCH_MLFLOW=1`` (or ``keep_run(mlflow=True)``) the same scalars also go to an MLflow run
named like the directory (``mlflow_log.py``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.ui.dashboard import mlflow_log
from workbench.ui.dashboard.curves import drawn_logs
from workbench.ui.dashboard.history import RunHistory

log = logging.getLogger("workbench.ui.dashboard.runs")

RUNS_ENV = "WORKBENCH_RUNS_DIR"
OFF = ("off", "none", "0")
TIERS = (("device", "device_allocated", "device_peak"), ("host", "host_rss", "host_peak"),
         ("disk", "disk_spill", "disk_spill"))
CURVE_TAGS = (("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm"),
              ("train/loss_scale", "loss_scale"))


@dataclass
class KeptRun:
    """One kept run: its history while the session lasts, its directory if one was written."""

    label: str
    plan: str
    history: RunHistory | None
    path: Path | None
    figures: dict[str, Any] = field(default_factory=dict)  # tokens_per_s, peak_memory
    written: threading.Event = field(default_factory=threading.Event)
    mlflow_run_id: str | None = None  # set once logged to MLflow (``mlflow_log.py``)

    def wait(self, timeout_s: float = 60.0) -> Path | None:
        """The run directory once its files are written (None: keeping is off or failed)."""
        if not self.written.wait(timeout_s):
            raise TimeoutError(f"the run {self.label!r} was not written in {timeout_s} s")
        return self.path


SESSION_RUNS: list[KeptRun] = []  # this session's kept runs, newest last


def runs_root(root: str | os.PathLike[str] | None = None) -> Path | None:
    """Where run directories go (see the module docstring); None: keeping is off."""
    if root is None:
        root = os.environ.get(RUNS_ENV) or Path.cwd() / "runs"
    if str(root).strip().lower() in OFF:
        return None
    return Path(root).expanduser()


def run_name(label: str, started: float) -> str:
    """``<time>-<name>``: the start time, then the cell's magic line as a safe file name."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    words = re.sub(r"[^A-Za-z0-9=.]+", "-", label.replace("%%colossal", "")).strip("-.")
    return f"{stamp}-{(words or 'run')[:60]}"


def figures_of(history: RunHistory) -> dict[str, Any]:
    """What ``compare`` draws besides the curves: tokens/s (all ranks, mean over the run's
    points with throughput) and peak memory per tier (bytes, the largest rank's)."""
    totals = [sum(r["tokens_per_s"] for r in p.ranks.values()) for p in history.points]
    moving = [t for t in totals if t > 0]
    peak: dict[str, int] = {}
    for tier, _, key in TIERS:
        peak[tier] = max((int(s.get("memory", {}).get(key, 0) or 0)
                          for s in history.latest.values()), default=0)
    return {"tokens_per_s": sum(moving) / len(moving) if moving else 0.0, "peak_memory": peak}


def trained(history: RunHistory) -> bool:
    """Whether the cell ran ``train_step`` (only such cells get a run directory)."""
    return any(log_.train for log_ in history.curves.values())


def keep_run(history: RunHistory, root: str | os.PathLike[str] | None = None,
             background: bool = True, mlflow: bool | None = None) -> KeptRun | None:
    """Keep a finished cell's run if it trained: in ``SESSION_RUNS`` and, unless keeping is
    off, as a run directory; None if the cell did not train. ``mlflow`` (default:
    ``$WORKBENCH_MLFLOW``) also logs it to MLflow (``mlflow_log.py``); asked for explicitly
    without mlflow installed, that is an ImportError saying how to install it.

    The files are written in a background thread by default: the first write imports torch's
    TensorBoard writer into the notebook's process (seconds), which the cell should not wait
    for; ``KeptRun.wait()`` waits for them (and for the MLflow run)."""

    to_mlflow = mlflow_log.mlflow_wanted(mlflow)
    missing = mlflow_log.mlflow_missing() if to_mlflow else None
    if missing and mlflow:
        raise ImportError(missing)
    if missing:  # asked for by the environment: the run is still kept
        log.warning("%s", missing)
        to_mlflow = False
    if not trained(history):
        return None
    run = KeptRun(history.label, history.plan, history, None, figures_of(history))
    SESSION_RUNS.append(run)
    base = runs_root(root)

    def write() -> None:
        try:
            if base is not None:
                run.path = write_run(history, base, run.figures)
        except Exception as err:  # a full disk must not fail the cell
            log.warning("could not keep the run under %s: %s", base, err)
        try:
            if to_mlflow:
                name = run.path.name if run.path is not None \
                    else run_name(history.label, history.wall_started)
                run.mlflow_run_id = mlflow_log.log_run(history, name, scalars(history))
        except Exception as err:  # an unreachable tracking server must not fail the cell
            log.warning("could not log the run to MLflow: %s", err)
        finally:
            run.written.set()

    if background:
        threading.Thread(target=write, name="workbench-keep-run", daemon=True).start()
    else:
        write()
    return run


def write_run(history: RunHistory, root: Path, figures: dict[str, Any]) -> Path:
    """Write ``history`` as a new run directory under ``root``; its path."""
    from torch.utils.tensorboard import SummaryWriter

    path = root / run_name(history.label, history.wall_started)
    n = 1
    while path.exists():
        n += 1
        path = root / f"{run_name(history.label, history.wall_started)}-{n}"
    path.mkdir(parents=True)
    meta = {"label": history.label, "plan": history.plan, "ranks": history.ranks,
            "started": history.wall_started, "seconds": history.elapsed, **figures}
    (path / "run.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    writer = SummaryWriter(log_dir=str(path))
    try:
        _write_scalars(writer, history)
        writer.add_text("plan", f"`{history.plan or '(the pool default)'}`")
        writer.add_text("cell", f"`{history.label}`")
    finally:
        writer.close()
    return path


def _write_scalars(writer: Any, history: RunHistory) -> None:
    for tag, value, step, walltime in scalars(history):
        writer.add_scalar(tag, value, step, walltime, new_style=True, double_precision=True)


Scalar = tuple[str, float, int, "float | None"]  # (tag, value, step, wall time or None)


def scalars(history: RunHistory) -> Iterator[Scalar]:
    """Every scalar a run directory gets (the module docstring lists them), in the order
    written; the MLflow run (``mlflow_log.py``) logs the very same ones."""
    return (row for row in _all_scalars(history) if row[1] is not None)


def _all_scalars(history: RunHistory) -> Iterator[Scalar]:
    """``scalars``, values not measured (None: no grad norm without clipping) included."""
    drawn = drawn_logs(history.curves)
    last = 0
    for rank, curves in drawn.items():
        suffix = f"/rank{rank}" if len(drawn) > 1 else ""
        skipped = 0
        for step in sorted(curves.train):
            row = curves.train[step]
            skipped += 0 if row["stepped"] else 1
            for tag, key in CURVE_TAGS:
                yield (tag + suffix, row[key], step, None)
            yield ("train/skipped_steps" + suffix, skipped, step, None)
            last = max(last, step)
        for (step, _), loss in sorted(curves.eval.items()):
            yield ("eval/loss" + suffix, loss, step, None)
    step_at = 0  # points are in time order; their training step never goes back
    for point in history.points:
        step_at = max([step_at, *(r.get("train_steps", 0) for r in point.ranks.values())])
        wall = history.wall_started + point.t
        for rank, summary in sorted(point.ranks.items()):
            yield (f"throughput/tokens_per_s/rank{rank}", summary["tokens_per_s"], step_at,
                   wall)
        for axis in {a for r in point.ranks.values() for a in r["comm_bytes"]}:
            yield (f"comm/{axis}", sum(r["comm_bytes"].get(axis, 0)
                                       for r in point.ranks.values()), step_at, wall)
        for axis in {a for r in point.ranks.values() for a in r["p2p_bytes"]}:
            yield (f"p2p/{axis}", sum(r["p2p_bytes"].get(axis, 0)
                                      for r in point.ranks.values()), step_at, wall)
    last = max(last, step_at)
    for rank, snap in sorted(history.latest.items()):
        memory = snap.get("memory", {})
        for tier, now, peak in TIERS:
            yield (f"memory/{tier}/rank{rank}", memory.get(now, 0), last, None)
            yield (f"memory_peak/{tier}/rank{rank}", memory.get(peak, 0), last, None)
        for part in ("compute", "comm", "waiting"):
            yield (f"time/{part}/rank{rank}", snap.get("seconds", {}).get(part, 0.0),
                   last, None)

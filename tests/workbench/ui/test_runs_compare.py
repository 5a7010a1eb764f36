"""Runs kept and compared, on the notebook side (no engines): the curves a cell's ranks published
become a run directory that TensorBoard's own reader reads back exactly, and ``compare`` draws
two such directories in one figure with their plans in the legend.

What is protected: ``keep_run`` writes ``<root>/<time>-<name>/`` with TensorBoard events whose
``train/loss``, ``train/lr``, ``train/grad_norm`` and ``eval/loss`` read by ``EventAccumulator``
equal the published values exactly (doubles), and the plan as text; a cell that did not train
keeps nothing; ``WORKBENCH_RUNS_DIR=off`` keeps the run in the session only; the curves panel of
the notebook's figure and of the lab page's pool-state block draw the same raw values; and
``compare`` overlays two run directories (after a "restart": from files alone), the loss
curves smoothed as the dashboard's, tokens/s and peak memory per tier from ``run.json``.
"""

from __future__ import annotations

import pytest

from kernels_runtime.telemetry import TELEMETRY_KEY, Telemetry
from workbench.ui.dashboard import runs
from workbench.ui.dashboard.compare import compare, read_run_dir
from workbench.ui.dashboard.curves import smooth
from workbench.ui.dashboard.figures import build_curve_figure, trace_data
from workbench.ui.dashboard.history import RunHistory
from workbench.ui.lab.state import _cell_block

LOSSES = [2.0 / (i + 1) + 1e-9 * i for i in range(6)]  # not round in float32


def _history(plan: str, losses: list[float], tokens_per_s: float) -> RunHistory:
    """A cell's history as the notebook gets it: real ``Telemetry`` snapshots of 2 ranks
    whose curves were recorded as ``train_step`` records them."""
    history = RunHistory([0, 1], label=f'%%colossal --plan "{plan}"', plan=plan)
    tels = [Telemetry(None, memory=lambda r=r: {"host_rss": 1000 + r, "host_peak": 2000 + r})
            for r in range(2)]
    for step, loss in enumerate(losses):
        for tel in tels:
            tel.record_train(loss, True, 0.5 + step, 0.1 / (step + 1), None)
            if step == 3:
                tel.record_eval(loss * 1.1)
        snaps = {r: {TELEMETRY_KEY: {**tel.snapshot(), "seq": step, "time": float(step),
                                     "throughput": {"tokens_per_s": tokens_per_s / 2}}}
                 for r, tel in enumerate(tels)}
        history.ingest(snaps)
    history.finish()
    return history


def test_a_kept_run_reads_back_exactly_with_tensorboards_reader(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    history = _history("dp=2", LOSSES, 100.0)
    kept = runs.keep_run(history, tmp_path, background=False)
    assert kept is not None and kept in runs.SESSION_RUNS
    path = kept.wait()
    assert path.parent == tmp_path and path.name.endswith("-plan-dp=2")
    events = EventAccumulator(str(path), size_guidance={"tensors": 0})
    events.Reload()

    def read(tag: str) -> tuple[list[int], list[float]]:
        rows = events.Tensors(tag)
        return [e.step for e in rows], [tensor_util.make_ndarray(e.tensor_proto).item()
                                        for e in rows]

    steps = list(range(1, len(LOSSES) + 1))
    assert read("train/loss") == (steps, LOSSES)  # exact
    assert read("train/lr") == (steps, [0.1 / s for s in steps])
    assert read("train/grad_norm") == (steps, [0.5 + s - 1 for s in steps])
    assert read("eval/loss") == ([4], [LOSSES[3] * 1.1])
    assert read("train/skipped_steps")[1] == [0] * len(steps)
    assert read("memory_peak/host/rank1")[1] == [2001]
    assert "throughput/tokens_per_s/rank0" in events.Tags()["tensors"]
    plan = tensor_util.make_ndarray(events.Tensors("plan/text_summary")[0].tensor_proto)
    assert b"dp=2" in plan.item()

    # the notebook's curves panel and the lab page's block draw the same raw values
    drawn = trace_data(build_curve_figure(history, widget=False))
    assert drawn["curves: loss"] == (steps, LOSSES)
    assert drawn["curves: loss (smoothed)"] == (steps, smooth(LOSSES))
    block = _cell_block(history, running=False)["curves"]
    lab = {t["name"]: t for t in block["traces"]}
    assert lab["curves: loss"]["y"] == LOSSES
    assert lab["curves: loss (smoothed)"]["meta"] == {"smooth_of": "curves: loss"}
    assert block["layout"]["yaxis"]["type"] == "log"


def test_a_cell_without_training_keeps_nothing_and_off_keeps_no_files(tmp_path,
                                                                      monkeypatch) -> None:
    assert runs.keep_run(RunHistory([0, 1], label="%%colossal"), tmp_path) is None
    monkeypatch.setenv(runs.RUNS_ENV, "off")
    kept = runs.keep_run(_history("dp=2", LOSSES[:2], 1.0), background=False)
    assert kept is not None and kept.wait() is None and runs.SESSION_RUNS[-1] is kept
    assert list(tmp_path.iterdir()) == []


def test_compare_draws_two_run_directories_with_their_plans(tmp_path) -> None:
    a = runs.keep_run(_history("dp=2", LOSSES, 100.0), tmp_path, background=False).wait()
    b = runs.keep_run(_history("dp=2 zero_stage=2", LOSSES[::-1], 300.0), tmp_path,
                      background=False).wait()
    assert read_run_dir(b).tokens_per_s == pytest.approx(300.0)
    fig = compare(a, b, smoothing=0.0)  # from the files alone, as after a restart
    data = trace_data(fig)
    assert data["dp=2"] == (list(range(1, 7)), LOSSES)
    assert data["dp=2 zero_stage=2"] == (list(range(1, 7)), LOSSES[::-1])
    assert data["dp=2 zero_stage=2: tokens/s"][1] == [pytest.approx(300.0)]
    assert data["dp=2: peak memory"] == (["device", "host", "disk"], [0, 2001, 0])
    legend = [t.name for t in fig.data if t.showlegend is not False]
    assert legend == ["dp=2", "dp=2 zero_stage=2"]
    assert trace_data(compare(-2, -1, smoothing=0.0))["dp=2"] == data["dp=2"]  # the session's
    with pytest.raises(FileNotFoundError, match="not a kept run"):
        compare(tmp_path)

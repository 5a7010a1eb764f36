"""The learning-rate plot and "compare with the previous run", on the notebook side (no ranks).

What is protected:
- the LR the curves panel draws (in the notebook's figure and in the lab page's pool-state
  block) is the one the optimizer had, and its axis starts at 0: plotly pads a constant series
  to ``[v - 1, v + 1]``, so ``AdamW(lr=1e-2)`` was drawn as a flat line at "0" on a -1..1 axis
  (issue 33's dark dashboard-page screenshot) although the published values were right;
- after two cells that trained, the pool-state file holds ``compare(previous, this)`` for the
  page's "compare with the previous run" button (the very traces ``workbench.compare`` draws),
  and none after the first; the notebook's figure gets a button that draws the same figure.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels_runtime.api.train import _lr_and_scale
from kernels_runtime.telemetry import TELEMETRY_KEY, Telemetry
from workbench.ui.dashboard import runs
from workbench.ui.dashboard.compare import compare
from workbench.ui.dashboard.figures import build_curve_figure, trace_data
from workbench.ui.dashboard.history import RunHistory
from workbench.ui.dashboard.live import LiveDashboard
from workbench.ui.dashboard.previous import BUTTON_TEXT, CompareButton, previous_run
from workbench.ui.lab import state as state_module
from workbench.ui.lab.state import PoolStateFile, _cell_block, read_pool


def _snapshots(losses: list[float], lr: float) -> list[dict[int, dict]]:
    """What 2 ranks publish step by step: real ``Telemetry`` snapshots recorded as
    ``train_step`` records them (the same loss on both: it is averaged over dp)."""
    tels = [Telemetry(None, memory=lambda r=r: {"host_rss": 1000 + r, "host_peak": 2000 + r})
            for r in range(2)]
    out = []
    for step, loss in enumerate(losses):
        for tel in tels:
            tel.record_train(loss, True, None, lr, None)
        out.append({r: {TELEMETRY_KEY: {**tel.snapshot(), "seq": step, "time": float(step),
                                        "throughput": {"tokens_per_s": 50.0}}}
                    for r, tel in enumerate(tels)})
    return out


def test_the_lr_plot_draws_the_optimizers_lr_on_an_axis_from_zero() -> None:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-2)
    lr, scale = _lr_and_scale(optimizer)  # what train_step publishes
    assert (lr, scale) == (1e-2, None)
    history = RunHistory([0, 1], label="%%colossal")
    for snaps in _snapshots([3.0, 2.5, 2.0], lr):
        history.ingest(snaps)
    history.finish()
    block = _cell_block(history, running=False)["curves"]  # what the lab page reads
    lab = {t["name"]: t for t in block["traces"]}
    assert lab["curves: lr"]["y"] == [1e-2] * 3 and lab["curves: lr"]["yaxis"] == "y2"
    assert block["layout"]["yaxis2"]["rangemode"] == "tozero"  # not [-0.99, 1.01]
    fig = build_curve_figure(history, widget=False)  # the notebook's figure
    assert trace_data(fig)["curves: lr"] == ([1, 2, 3], [1e-2] * 3)
    assert fig.layout.yaxis2.rangemode == "tozero"


def test_the_pool_state_file_offers_compare_with_the_previous_run(tmp_path,
                                                                   monkeypatch) -> None:
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    pool = PoolStateFile(enabled=True, min_interval_s=0.0)
    cells = []
    for plan, losses in (("dp=2", [3.0, 2.0, 1.5]), ("dp=2 zero=2", [3.0, 1.8, 1.2])):
        pool.cell_started(f'%%colossal --plan "{plan}"', [0, 1])
        for snaps in _snapshots(losses, 1e-2):
            pool.cell_data(snaps)
        pool.cell_data({}, final=True)
        pool.cell_finished()
        cells.append(pool.history)
        doc = read_pool(pool.pool_id, tmp_path / "workbench")
        assert doc is not None
        if len(cells) == 1:
            assert doc["cell"]["compare"] is None  # nothing to compare with yet
    panel = doc["cell"]["compare"]
    want = {t.name: list(t.y) for t in compare(*cells).data if t.type == "scatter"}
    got = {t["name"]: t["y"] for t in panel["traces"] if t["type"] == "scatter"}
    assert got == want and len(got) == 2  # the very figure workbench.compare draws
    assert {"height", "template"}.isdisjoint(panel["layout"])  # the page sizes and themes
    assert "previous run" in panel["title"]
    # the page draws it: its button and panel, and the script reads cell.compare
    static = Path(state_module.__file__).parent / "static"
    assert 'id="compare-button"' in (static / "dashboard.html").read_text()
    assert "cell.compare" in (static / "dashboard.js").read_text()


def test_the_notebook_offers_compare_with_the_previous_run(monkeypatch) -> None:
    monkeypatch.setenv(runs.RUNS_ENV, "off")  # kept in the session only: no files
    shown: list = []
    sinks = []
    for plan, losses in (("dp=2", [3.0, 2.0]), ("dp=2 zero=2", [3.0, 1.5])):
        sink = LiveDashboard([0, 1], mode="on", plan=plan, label="%%colossal",
                             display=shown.append)
        sink.start()
        for snaps in _snapshots(losses, 1e-2):
            sink(snaps, final=False)
        sink({}, final=True)
        sinks.append(sink)
    button = sinks[1].compare_button  # (the first cell's compares with an earlier test's)
    assert isinstance(button, CompareButton) and shown[-1] is button
    assert (button.previous, button.this) == (sinks[0].kept, sinks[1].kept)
    assert previous_run(runs.SESSION_RUNS[0]) is None  # the session's first run: no button
    assert button.button.description == BUTTON_TEXT
    button.button.click()
    names = [t.name for t in button.figure.data if t.showlegend is not False]
    assert names == ["dp=2", "dp=2 zero=2"] and button.button.disabled

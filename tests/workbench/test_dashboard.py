"""The live dashboard: what it plots is what the ranks counted, and it moves while a cell runs.

What is protected: after a ``%%colossal`` training run (dp=2, real engines, gloo) every figure
value equals the runtime's own counters on rank 0 and rank 1 (CommStats per axis, the last
published telemetry snapshot); the figure changes several times while a cell is still running;
``--dashboard``/``--no-dashboard``/auto decide when it is shown; the history stays bounded;
``to_html`` writes a standalone report holding the plot data. Under a real pp=2 pipeline a
shown dashboard gains the stage timeline while the cell runs: one row per pipeline rank, a bar
per forward and backward labelled by micro-batch where the rank's own published timeline
says, the receive waits as idle bars and each rank's bubble in the title, and the pipeline's
point-to-point bytes as their own "p2p: pp" line equal to the sends the ranks counted; the
report holds the timeline too. A run without a pipeline has no stage timeline and no p2p line.
"""

from __future__ import annotations

import pytest
from ipyparallel import interactive

import workbench
from kernels_runtime.telemetry import TELEMETRY_KEY
from workbench.dashboard import LiveDashboard, RunHistory
from workbench.dashboard.figures import build_figure, build_stage_figure, trace_data
from workbench.execution import run_cell
from workbench.magics import active_magics, active_pool

from helpers.reports import report_traces

SETUP = """
import time
import torch
from kernels_runtime.api import parallelize, train_step
from kernels_runtime.mesh.context import ParallelContext

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64)

    def forward(self, input_ids, labels):
        logits = self.out(self.emb(input_ids))  # (b, s, vocab)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

torch.manual_seed(0)
model = Tiny()
model, opt = parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                         ctx=ParallelContext.build(plan, comm))

def batch(step):
    g = torch.Generator().manual_seed(2 * step + rank)
    ids = torch.randint(0, 64, (4, 16), generator=g)  # (b, s): 64 tokens per rank and step
    return [(ids, ids)]
"""
PSI = 64 * 32 + 32 * 64 + 64

PIPELINE_SETUP = """
import time
import torch
from torch import nn
from kernels_runtime.api import parallelize, train_step
from kernels_runtime.mesh.context import ParallelContext

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                      nn.Linear(16, 2))
model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         ctx=ParallelContext.build(plan, comm), verbose=False)

def mse(m, b):
    return nn.functional.mse_loss(m(b[0]), b[1])

def pipeline_step(step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)  # 4 micro-batches
    return train_step(model, opt, list(zip(x.chunk(4), y.chunk(4))), mse)
"""


@interactive
def _rank_counters() -> tuple[dict, dict]:
    return globals()["session"].telemetry.last_published, globals()["comm"].stats.snapshot()


@interactive
def _pipeline_counters() -> tuple[dict, dict, dict]:
    g = globals()
    return (g["session"].telemetry.last_published, g["comm"].stats.snapshot(),
            g["model"].parallel_state.schedule.last_timeline)


def _snapshot(steps: int, rank: int, axis_bytes: int = 100) -> dict:
    return {TELEMETRY_KEY: {
        "seq": steps, "time": 1.0 + steps, "steps": steps,
        "seconds": {"step": 1.0 * steps, "compute": 0.5 * steps, "comm": 0.25 * steps,
                    "waiting": 0.25 * steps},
        "throughput": {"tokens_per_s": 10.0 * rank + steps, "samples_per_s": 1.0,
                       "flops_per_s": 1e9},
        "memory": {"device_allocated": 0, "host_rss": 1000 + rank, "disk_spill": 7},
        "comm_by_axis": {"dp": {"calls": steps, "bytes": axis_bytes * steps}},
    }}


# ---- notebook side only ------------------------------------------------------------------
def test_history_keeps_new_points_only_and_stays_bounded() -> None:
    history = RunHistory([0, 1], max_points=10)
    assert history.ingest({0: _snapshot(1, 0), 1: {}})
    assert not history.ingest({0: _snapshot(1, 0), 1: {}})  # same snapshot polled again
    for step in range(2, 50):
        history.ingest({0: _snapshot(step, 0), 1: _snapshot(step, 1)})
    assert len(history.points) <= 10
    assert history.points[-1].ranks[1]["tokens_per_s"] == 10.0 + 49
    assert history.times() == sorted(history.times())
    assert history.comm_bytes("dp")[-1] == 2 * 100 * 49


def test_figure_values_are_the_snapshots_values() -> None:
    history = RunHistory([0, 1])
    history.ingest({0: _snapshot(3, 0), 1: _snapshot(3, 1)})
    data = trace_data(build_figure(history, widget=False))
    assert data["memory: host"] == (["rank 0", "rank 1"], [1000, 1001])
    assert data["memory: disk"][1] == [7, 7]
    assert data["time: compute"][1] == [1.5, 1.5] and data["time: waiting"][1] == [0.75, 0.75]
    assert data["comm: dp"][1] == [600]
    assert data["tokens/s: rank 1"][1] == [13.0]


def test_dashboard_modes_decide_when_it_is_shown() -> None:
    clock = [0.0]
    shown: dict[str, list] = {}
    for mode in ("auto", "on", "off"):
        shown[mode] = []
        live = LiveDashboard([0], mode=mode, display=shown[mode].append, clock=lambda: clock[0])
        clock[0] = 0.0
        live.start()
        clock[0] = 1.0
        live({0: _snapshot(1, 0)}, False)
        assert len(shown[mode]) == (1 if mode == "on" else 0), mode
        clock[0] = 2.5
        live({0: _snapshot(2, 0)}, False)
        assert len(shown[mode]) == (0 if mode == "off" else 1), mode
        assert live.history.has_data  # kept in every mode, for workbench.dashboard()
    quick = LiveDashboard([0], display=shown["auto"].append, clock=lambda: clock[0])
    quick({0: {}}, True)  # a cell that published nothing is never shown
    assert len(shown["auto"]) == 1


# ---- real engines ------------------------------------------------------------------------
@pytest.mark.engines
def test_dashboard_figures_equal_the_runtime_counters(shell, tmp_path, capsys) -> None:
    steps = 6
    shell.run_cell_magic("colossal", '--plan "dp=2" --dashboard',
                         SETUP + f"for step in range({steps}):\n    train_step(model, opt, "
                                 "batch(step))\n")
    assert "colossal dashboard: ranks [0, 1]" in capsys.readouterr().out  # shown, as text here
    history = active_magics(shell).last_run
    pool = active_pool(shell)
    counters = pool.view([0, 1]).apply_sync(_rank_counters)
    for rank, (published, _) in enumerate(counters):
        assert history.latest[rank] == published  # the final flush reached the notebook
        assert published["steps"] == steps and published["tokens"] == 64 * steps
        assert published["flops"] == 6 * PSI * published["tokens"]
        seconds = published["seconds"]
        assert seconds["comm"] > 0 and seconds["compute"] > 0
        assert seconds["compute"] + seconds["comm"] + seconds["waiting"] == pytest.approx(
            seconds["step"], rel=1e-9)

    data = trace_data(workbench.dashboard().figure)
    dp_bytes = sum(c["bytes"] for _, stats in counters for c in
                   (groups["dp"] for groups in stats.values() if "dp" in groups))
    assert dp_bytes > 0 and data["comm: dp"][1][-1] == dp_bytes
    labels = ["rank 0", "rank 1"]
    for name, key in (("memory: host", "host_rss"), ("memory: device", "device_allocated"),
                      ("memory: disk", "disk_spill")):
        assert data[name] == (labels, [p["memory"][key] for p, _ in counters])
    for part in ("compute", "comm", "waiting"):
        assert data[f"time: {part}"][1] == [p["seconds"][part] for p, _ in counters]
    assert workbench.dashboard().stage_figure is None  # no pipeline ran
    assert not [name for name in data if name.startswith(("stage:", "p2p:"))]
    for rank, (published, _) in enumerate(counters):
        tokens_per_s = data[f"tokens/s: rank {rank}"][1][-1]
        assert tokens_per_s == published["throughput"]["tokens_per_s"] > 0

    report = workbench.dashboard().to_html(tmp_path / "report.html")
    assert report_traces(report) == data  # the standalone report holds the same data


@pytest.mark.engines
def test_figure_changes_while_the_cell_runs(shell) -> None:
    shell.run_cell_magic("colossal", '--plan "dp=2" --no-dashboard', SETUP)
    live = LiveDashboard([0, 1], mode="on", display=lambda view: None)
    seen: list[dict] = []  # distinct figure contents seen before the cell ended

    def sink(data: dict, final: bool) -> None:
        live(data, final)
        if not final:
            now = trace_data(live.view.figure)
            if not seen or seen[-1] != now:
                seen.append(now)

    live.start()
    code = "for step in range(15):\n    train_step(model, opt, batch(step))\n    time.sleep(0.2)"
    run_cell(active_pool(shell), code, stream=lambda *a: None, display=lambda *a: None,
             data_sink=sink)
    assert len(seen) >= 3, f"the figure changed {len(seen) - 1} times while the cell ran"
    assert live.refreshes >= 2
    throughput = seen[-1]["tokens/s: rank 0"][1]
    assert len(throughput) >= 2 and throughput[-1] > 0


@pytest.mark.engines
def test_stage_timeline_appears_while_a_pipeline_cell_runs(shell, tmp_path) -> None:
    shell.run_cell_magic("colossal", '--plan "pp=2 mb=4" --no-dashboard', PIPELINE_SETUP)
    live = LiveDashboard([0, 1], mode="on", display=lambda view: None)
    shown: list[int] = []  # figures in the shown box, while the cell ran

    def sink(data: dict, final: bool) -> None:
        live(data, final)
        if not final:
            shown.append(len(live.view.widget.children))

    live.start()  # shown before any pipeline step: the main figure alone
    assert live.view.widget.children == (live.view.figure,)
    code = "for step in range(12):\n    pipeline_step(step)\n    time.sleep(0.2)"
    run_cell(active_pool(shell), code, stream=lambda *a: None, display=lambda *a: None,
             data_sink=sink)
    assert 2 in shown, f"the stage timeline never joined the shown dashboard: {shown}"
    assert live.view.widget.children == (live.view.figure, live.view.stage_figure)

    counters = active_pool(shell).view([0, 1]).apply_sync(_pipeline_counters)
    history, fig = live.history, live.view.stage_figure
    timelines = {}
    for rank, (published, _, raw) in enumerate(counters):
        assert history.latest[rank] == published  # the final flush reached the notebook
        timeline = timelines[rank] = published["pipeline"]
        assert timeline["stage"] == rank and timeline["schedule"] == "1f1b"
        assert len(timeline["events"]) == len(raw["events"]) == 8  # 4 forwards, 4 backwards
        assert timeline["p2p_bytes"] == raw["p2p_bytes"] > 0
    bars = {t.name: t for t in fig.data if t.name.startswith("stage:")}
    for kind in ("F (forward)", "B (backward)"):
        bar = bars[f"stage: {kind}"]
        for rank, timeline in timelines.items():
            row = f"rank {rank} · stage {rank}"
            mine = [e for e in timeline["events"] if e["kind"] == kind[0]]
            drawn = [(b, t) for y, b, t in zip(bar.y, bar.base, bar.text) if y == row]
            assert drawn == [(e["start"] + e["wait"], str(e["mb"])) for e in mine]
    waits = [e for t in timelines.values() for e in t["events"] if e["wait"] > 0]
    assert len(bars["stage: idle (waiting on a receive)"].x) == len(waits) > 0
    for rank, timeline in timelines.items():
        assert f"rank {rank} {timeline['bubble']:.0%}" in fig.layout.title.text
    assert list(fig.layout.yaxis.categoryarray) == ["rank 0 · stage 0", "rank 1 · stage 1"]
    fresh = build_stage_figure(history, widget=False)  # what the report and the lab page draw
    assert [(t.name, t.y, t.base) for t in fresh.data] == [(t.name, t.y, t.base) for t in fig.data]
    report = workbench.dashboard(history).to_html(tmp_path / "pipeline.html").read_text()
    assert report.count("Plotly.newPlot") == 2 and "pipeline stages" in report

    data = trace_data(live.view.figure)
    sent = sum(groups["send"]["pp"]["bytes"] for _, groups, _ in counters)
    assert data["p2p: pp"][1][-1] == sent > 0  # counted once, at the sender
    collectives = sum(c["bytes"] for _, groups, _ in counters for op, by_group in groups.items()
                      for group, c in by_group.items()
                      if group == "pp" and op not in ("send", "recv"))
    assert data["comm: pp"][1][-1] == collectives  # the loss all-reduce over the stages

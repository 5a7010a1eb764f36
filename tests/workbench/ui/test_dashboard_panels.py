"""The live dashboard's panels from snapshots alone (no engines): what it plots is what the
snapshots say.

What is protected: the history keeps new points only and stays bounded; every figure value is
the snapshots' value; ``--dashboard``/``--no-dashboard``/auto decide when it is shown; the
offload panel's bars are each rank's published model-state bytes per tier and its per-step
series the differences of the cumulative counters over the offloading steps between points,
and a previous cell's placement, whose counters no longer move, shows no panel. The same
panels fed by real ranks are ``test_dashboard.py``.
"""

from __future__ import annotations

import pytest

from kernels_runtime.telemetry import TELEMETRY_KEY, Telemetry
from workbench.ui.dashboard import LiveDashboard, RunHistory
from workbench.ui.dashboard.figures import build_figure, build_offload_figure, trace_data
from workbench.ui.dashboard.offload import offload_traces


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
        assert live.history.has_data  # kept in every mode, for workbench.show_dashboard()
    quick = LiveDashboard([0], display=shown["auto"].append, clock=lambda: clock[0])
    quick({0: {}}, True)  # a cell that published nothing is never shown
    assert len(shown["auto"]) == 1


def _offloading_steps(tels: list[Telemetry], step: int, repeat: int = 1) -> list[dict]:
    """``repeat`` offloading steps on every rank; returns each rank's published snapshot."""
    for _ in range(repeat):
        for rank, tel in enumerate(tels):
            tel.record_offload({"device": 64 * rank, "host": 1000 * step, "disk": 5000 + rank},
                               {"host->disk": 300 + step + rank, "disk->host": 200},
                               evictions=2 + rank, wait_seconds=0.01 * (rank + 1))
    return [{**tel.snapshot(), "seq": step} for tel in tels]


def _per_step(counters: list[list[dict]], name: str) -> list[float]:
    """Per poll: the difference of each rank's cumulative counter (a trace's name says which)
    from the previous poll, over its offloading steps in between, summed over ranks."""
    def count(block: dict) -> float:
        return block["evictions"] if name == "evictions" else block["moved"].get(
            name.removeprefix("moved: "), 0)

    return [sum((count(now) - count(before)) / (now["steps"] - before["steps"])
                for now, before in zip(counters[k], counters[k - 1]))
            for k in range(1, len(counters))]


def test_offload_panel_is_the_placement_and_the_differences_of_the_counters() -> None:
    tels, history = [Telemetry(), Telemetry()], RunHistory([0, 1])
    history.ingest({r: {TELEMETRY_KEY: {**tel.snapshot(), "seq": 0}}
                    for r, tel in enumerate(tels)})
    assert build_offload_figure(history, widget=False) is None  # no offload yet: no panel
    published = []
    for step, repeat in ((1, 1), (2, 1), (3, 3), (4, 1)):  # 3 steps between two polls once
        published.append(_offloading_steps(tels, step, repeat))
        history.ingest({r: {TELEMETRY_KEY: snap} for r, snap in enumerate(published[-1])})
    fig = build_offload_figure(history, widget=False)
    data = trace_data(fig)
    for tier in ("device", "host", "disk"):
        assert data[f"model state: {tier}"] == (
            ["rank 0", "rank 1"], [snap["offload"]["tiers"][tier] for snap in published[-1]])
    zero = {"moved": {}, "evictions": 0, "steps": 0}  # before the first record: no block
    counters = [[zero, zero]] + [[s["offload"] for s in snaps] for snaps in published]
    for name in ("moved: host->disk", "moved: disk->host", "evictions"):
        assert data[name][1] == pytest.approx(_per_step(counters, name)), name
    assert data["moved: host->disk"][1] == [603, 605, 607, 609]  # 300 + step + rank, per rank
    assert [t.name for t in fig.data] == list(data)  # unique names, each with its prefix
    assert all(n.startswith(("model state: ", "moved: ", "evictions")) for n in data)
    last = [s["offload"]["last_step"] for s in published[-1]]
    assert fig.layout.title.text == (
        f"model state per tier · {sum(sum(s['moved'].values()) for s in last)} B moved last "
        f"step · {sum(s['evictions'] for s in last)} evictions/step · "
        f"{sum(s['wait_seconds'] for s in last):.3f} s waited (all ranks)")

    later = RunHistory([0, 1])  # a later cell without offload: the counters stand still
    for seq in (10, 11):
        later.ingest({r: {TELEMETRY_KEY: {**tel.snapshot(), "seq": seq}}
                      for r, tel in enumerate(tels)})
    assert offload_traces(later) == {} and build_offload_figure(later) is None

"""The tuner drawn: memory bars, the step-time split, the candidates and their Pareto front.

What is protected: every bar the tuner draws is the planner's own number (``predict``'s memory
per tier and category, in MiB; a pipeline stage's bars its ``rank_peak``), so moving ``zero``
from 0 to 3 moves them by exactly the ZeRO formula; the step split adds up to the predicted
step time; the front drawn is exactly the non-dominated candidates; a click on a candidate (as
the browser sends it) moves the controls to that plan; and every control has its full label,
a tooltip and a label width that is not a fixed narrow column. No browser, no ranks.
"""

from __future__ import annotations

import math
from dataclasses import fields

import pytest

from kernels_runtime.mesh.plan import Plan
from workbench.planner import predict
from workbench.planner.memory import runtime_model_state_bytes
from workbench.planner.setting import CATEGORIES, TIERS
from workbench.tuner import Trial, Tuner
from workbench.tuner.breakdown import exposed_by_axis, pareto_front, step_split
from workbench.tuner.controls import GROUPS, LABELS, TOOLTIPS
from workbench.tuner.figures import MIB, trials_figure

SPEC = dict(hidden=64, layers=2, heads=2, vocab=256, seq=64, batch=4, model_type="gpt2",
            positions=64, activation="gelu_new", attention="sdpa")
DEEP = {**SPEC, "layers": 4}


def _bars(tuner: Tuner) -> dict[str, tuple[float, ...]]:
    return {trace.name: tuple(trace.y) for trace in tuner.figures.memory.data}


def _expected_bars(plan: str, tuner: Tuner) -> dict[str, tuple[float, ...]]:
    p = predict(plan, tuner.spec, "H100", world_size=tuner.world_size)
    return {f"{tier}: {c}": (p.memory_by_category(tier)[c] / MIB,) * tuner.world_size
            for tier in TIERS for c in CATEGORIES}


def test_zero_3_moves_the_memory_bars_by_the_zero_formula():
    tuner = Tuner(SPEC, world_size=2, hardware="H100")
    tuner._ipython_display_()  # shown as a cell's value: the figures start drawing
    assert tuner.figures.live
    before = _bars(tuner)
    assert before == _expected_bars("dp=2", tuner)  # the bars are predict's numbers
    psi = tuner.prediction.setting.psi_local
    tuner.controls["zero_stage"].value = 3  # what the browser does
    after = _bars(tuner)
    assert after == _expected_bars("dp=2 zero=3", tuner)
    # ZeRO-3 on 2 data ranks (fp32): params 4, grads 4, optimizer 8 bytes per parameter,
    # each halved (memory.py's accounting of the runtime's FSDP2 shards)
    for category, (was, now) in zip(("params", "grads", "optimizer"), zip(
            runtime_model_state_bytes(psi, 2, 0, "fp32"),
            runtime_model_state_bytes(psi, 2, 3, "fp32"))):
        assert (was, now) == (psi * {"params": 4, "grads": 4, "optimizer": 8}[category],
                              psi * {"params": 2, "grads": 2, "optimizer": 4}[category])
        for rank in range(2):
            assert after[f"device: {category}"][rank] - before[f"device: {category}"][rank] \
                == pytest.approx((now - was) / MIB, rel=1e-12)
    assert "zero=3" in tuner.figures.memory.layout.title.text
    # the synced state, what a browser view draws first, follows the edits (the view of a
    # widget created just before its edits would otherwise draw an empty figure)
    for fig in (tuner.figures.memory, tuner.figures.time):
        assert fig._widget_data == fig._data
        assert fig._widget_layout == fig._layout_obj._props
    tuner.controls["dp"].value = 4  # impossible on 2 ranks: no bars of a plan that is not
    assert tuner.error and tuner.figures.prediction_box.layout.display == "none"
    tuner.controls["dp"].value = 2
    assert tuner.figures.prediction_box.layout.display != "none" and _bars(tuner) == after
    # the step split is redrawn too, and adds up to the predicted step
    drawn = {t.name: t.x[0] for t in tuner.figures.time.data}
    assert drawn == step_split(tuner.prediction)
    assert math.fsum(drawn.values()) == pytest.approx(tuner.prediction.step_time, rel=1e-12)


def test_pipeline_ranks_show_their_own_stage():
    """Under pp each rank's bars are its stage's: the stage predict reports has its memory,
    every stage totals its ``rank_peak``; ranks sit on stages as the mesh places them."""
    tuner = Tuner(DEEP, world_size=2, hardware="H100", plan="pp=2 mb=4")
    tuner.figures.start()
    p = tuner.prediction
    assert p.pipeline is not None and tuner.error is None
    bars = _bars(tuner)
    for rank in range(2):  # pp=2 on 2 ranks: rank r is stage r
        device = sum(bars[f"device: {c}"][rank] for c in CATEGORIES)
        assert device == pytest.approx(p.pipeline.rank_peak[rank] / MIB, rel=1e-12)
    top = p.pipeline.memory_rank
    for c in CATEGORIES:
        assert bars[f"device: {c}"][top] == pytest.approx(
            p.memory_by_category("device")[c] / MIB, rel=1e-12)
    assert "pipeline bubble" in step_split(p)


@pytest.mark.parametrize("plan, spec, world", [
    ("dp=2 zero=2 bf16 mb=2", SPEC, 2),
    ("dp=1 tp=2 sp_mode=split_gather", SPEC, 2),
    ("dp=2 tp=2 tp_mode=1d sp=2 sp_mode=ring zero=1", SPEC, 8),
    ("dp=1 pp=2 schedule=interleaved chunks=2 mb=4", DEEP, 2),
    ("dp=2 zero=2 offload=static offload_params=0.5 offload_optim=1", SPEC, 2),
])
def test_step_split_adds_up_to_the_step(plan, spec, world):
    tuner = Tuner(spec, world_size=world, hardware="H100", plan=plan)
    p = tuner.prediction
    assert p is not None, tuner.error
    split = step_split(p)
    assert math.fsum(split.values()) == pytest.approx(p.step_time, rel=1e-12)
    assert ("offload I/O" in split) == (p.plan.offload != "none")
    exposed = exposed_by_axis(p)
    assert math.fsum(e for e, _ in exposed.values()) == pytest.approx(p.exposed_comm_time,
                                                                      rel=1e-12, abs=1e-18)
    for axis, seconds in p.comm_by_axis().items():  # exposed + hidden = all of the axis
        assert math.fsum(exposed[axis]) == pytest.approx(seconds, rel=1e-12)


def test_pareto_front_is_the_non_dominated_points():
    points = [(1, 5), (2, 3), (2, 4), (3, 3), (4, 1), (4, 1), (5, 0.5), (0.5, 9), (6, 9)]
    front = pareto_front(points)
    brute = [i for i, (x, y) in enumerate(points)
             if not any(a <= x and b <= y and (a, b) != (x, y) for a, b in points)]
    assert sorted(front) == sorted(brute) == [0, 1, 4, 5, 6, 7]


def test_recommend_draws_the_candidates_and_a_click_selects_one():
    tuner = Tuner(SPEC, world_size=2, hardware="H100", memory_budget=4 * 2**20)
    rec = tuner.recommend()  # before the tuner is shown: kept, drawn when shown
    assert tuner.figures.candidates_box.layout.display == "none"
    tuner.figures.start()
    fig = tuner.figures.candidates
    traces = {t.name: t for t in fig.data}
    drawn = [(x, y, plan) for name in ("candidates: within the budget",
                                       "candidates: over the budget")
             for x, y, plan in zip(traces[name].x, traces[name].y, traces[name].customdata)]
    assert len(drawn) == len(rec.ranked) + len(rec.over_budget)
    assert tuner.figures.candidates_box.layout.display != "none"
    # the front drawn is exactly the candidates no other beats on both memory and time
    dominated = {plan for x, y, plan in drawn
                 if any(a <= x and b <= y and (a, b) != (x, y) for a, b, _ in drawn)}
    assert set(traces["Pareto front"].customdata) == {p for *_, p in drawn} - dominated
    assert traces["recommended"].customdata == (rec.plan.to_string(),)
    # a click as the browser reports it: point 3 of the over-budget trace
    index = [t.name for t in fig.data].index("candidates: over the budget")
    wanted = Plan.parse(fig.data[index].customdata[3])
    fig._js2py_pointsCallback = {"event_type": "plotly_click", "points": {
        "xs": [0], "ys": [0], "point_indexes": [3], "trace_indexes": [index]}}
    assert tuner.plan == wanted and tuner.values == wanted.as_dict()
    assert {t.name: t for t in fig.data}["selected"].customdata == (wanted.to_string(),)
    assert "selected" in tuner.message
    tuner.select(rec.plan)  # the method the click calls
    assert tuner.plan == rec.plan


def test_every_control_has_its_full_label_and_tooltip():
    tuner = Tuner(SPEC, world_size=2, hardware="H100")
    grouped = [name for names in GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(f.name for f in fields(Plan))  # each once, ep included
    assert set(GROUPS) == {"data", "tensor", "pipeline", "sequence", "expert", "memory",
                           "precision"}
    for name, control in [*tuner.controls.items(), ("hardware", tuner.hardware_control)]:
        assert control.description == LABELS.get(name, "predict on")
        assert not control.description.endswith(("...", "…"))
        assert control.tooltip and control.tooltip == TOOLTIPS.get(name, control.tooltip)
        # a label as wide as its text: no fixed label column, no fixed narrow widget
        assert control.style.description_width == "initial", name
        assert control.layout.width == "auto", name
    # a None field shows its menu's entry, not an empty menu (ipywidgets blanks a None value)
    assert (tuner.controls["dp"].label, tuner.controls["device_mem"].label) == (
        "auto", "unlimited")
    assert tuner.values["dp"] is None and tuner.plan.dp == 2
    tuner.set(dp=2)
    tuner.set(dp=None)
    assert tuner.controls["dp"].label == "auto" and tuner.values["dp"] is None
    shown = [w for box in tuner.widget.children[1].children for w in box.children[1:]]
    assert shown == [*(tuner.controls[n] for n in grouped), tuner.hardware_control]


def test_trials_are_drawn_predicted_against_measured():
    trials = [Trial("dp=2 zero=0 fp32", "H100", 0.010, 3 * MIB, 0.012, 4 * MIB, steps=3),
              Trial("dp=2 zero=3 fp32", "H100", 0.020, 2 * MIB, error="refused"),
              Trial("dp=2 zero=1 bf16", "H100", 0.008, 2 * MIB, 0.006, 2 * MIB, steps=3)]
    fig = trials_figure(trials)
    time, memory = (next(t for t in fig.data if t.name == f"{k}: trials")
                    for k in ("time", "memory"))
    assert time.x == (0.012, 0.006) and time.y == (0.010, 0.008)
    assert memory.x == (4.0, 2.0) and memory.y == (3.0, 2.0)
    assert time.text == ("1", "3")  # the table's row numbers; the failed trial is left out

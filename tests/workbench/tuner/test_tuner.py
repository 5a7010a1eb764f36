"""The plan tuner widget: controls, live validation and prediction, Measure, Use this plan.

Widgets are driven the way the browser drives them: a control's ``value`` is set (the observe
handlers run) and buttons are ``click()``ed (the on_click handlers run). Trials run on a real
2-rank pool.
"""

from __future__ import annotations

import html
from dataclasses import fields

import pytest

from kernels_runtime.mesh.plan import Plan, PlanError
from workbench.planner import ModelSpec, predict
from workbench.planner.cost_model import plan_label
from workbench.tuner import Tuner

SPEC = dict(hidden=64, layers=2, heads=2, vocab=256, seq=64, batch=4, model_type="gpt2",
            positions=64, activation="gelu_new", attention="sdpa")

# (controls to set, why it is invalid): each must show Plan.validate's own words
INVALID = [
    ({"dp": 4}, "product larger than the pool"),
    ({"dp": 1}, "product smaller than the pool"),
    ({"tp_mode": "2d", "tp": 1}, "2d needs a square tp"),
    ({"tp_depth": 2}, "depth without 2.5d"),
    ({"dp": 1, "tp": 2, "heads_odd": True}, "heads not divisible by tp"),
    ({"dp": 1, "pp": 4}, "more stages than the pool"),
    ({"zero_stage": 3, "dp": 1, "pp": 2}, "ZeRO-3 with pipeline"),
    ({"dp": 1, "sp": 2, "sp_mode": "all_to_all", "heads_odd": True}, "heads not divisible by sp"),
]


def _tuner(**options) -> Tuner:
    return Tuner(SPEC, world_size=2, hardware="H100", **options)


def test_every_plan_field_has_a_control():
    tuner = _tuner()
    assert set(tuner.controls) == {f.name for f in fields(Plan)}
    assert tuner.error is None and tuner.plan == Plan(dp=2)


def test_prediction_updates_as_controls_move():
    tuner = _tuner()
    before = tuner.prediction_pane.value
    ddp = tuner.prediction.peak_bytes
    tuner.controls["zero_stage"].value = 3  # what the browser does
    assert tuner.plan == Plan(dp=2, zero_stage=3)
    expected = predict("dp=2 zero=3", tuner.spec, "H100", world_size=2)
    assert tuner.prediction.peak_bytes == expected.peak_bytes < ddp
    assert tuner.prediction.step_time == expected.step_time
    assert tuner.prediction_pane.value != before and "zero=3" in tuner.prediction_pane.value
    tuner.controls["precision"].value = "bf16"
    tuner.controls["activation_checkpointing"].value = True
    assert tuner.plan == Plan(dp=2, zero_stage=3, precision="bf16", activation_checkpointing=True)


@pytest.mark.parametrize("values, why", INVALID, ids=[w for _, w in INVALID])
def test_invalid_combination_shows_plan_validate_text(values, why):
    values = dict(values)
    spec = dict(SPEC)
    if values.pop("heads_odd", False):
        spec["heads"] = 3
        spec["hidden"] = 63
    tuner = Tuner(spec, world_size=2, hardware="H100")
    tuner.set(**values)
    plan = Plan(**tuner.values)
    with pytest.raises(PlanError) as expected:
        plan.validate(2, ModelSpec.from_config(spec).plan_config())
    assert tuner.error == str(expected.value)
    assert tuner.plan is None and tuner.prediction is None
    assert html.escape(str(expected.value)) in tuner.prediction_pane.value
    # the buttons are harmless: nothing measured, the default plan untouched
    tuner.measure_button.click()
    assert tuner.trials == [] and "invalid" in tuner.message
    assert tuner.use() is None


def test_measure_without_a_pool_does_nothing():
    tuner = _tuner()
    tuner.measure_button.click()
    assert tuner.trials == []
    assert "no pool is running" in tuner.message and "%colossal start -n 2" in tuner.message


def test_unknown_hardware_and_fields_are_clear_errors():
    with pytest.raises(ValueError, match="hardware='TPU' is unknown; choose one of A100"):
        Tuner(SPEC, world_size=2, hardware="TPU")
    with pytest.raises(ValueError, match="not plan fields: zero"):
        _tuner().set(zero=2)


def test_recommend_moves_the_controls():
    tuner = _tuner(memory_budget=4 * 2**20)
    tuner.recommend_button.click()
    assert tuner.plan is not None and tuner.prediction.peak_bytes <= 4 * 2**20
    assert "fits" in tuner.prediction_pane.value
    assert plan_label(tuner.plan) in tuner.message  # the explanation names the choice


GRID_SPEC = {**SPEC, "heads": 4}  # q = 2 columns of whole heads


def test_grid_modes_are_predicted_with_the_grid_terms():
    """The tp mode and depth controls reach the cost model's 2D / 2.5D terms."""
    tuner = Tuner(GRID_SPEC, world_size=8, hardware="H100")
    tuner.set(dp=2, tp=4, tp_mode="2d")
    assert tuner.error is None and tuner.plan == Plan(dp=2, tp=4, tp_mode="2d")
    expected = predict("dp=2 tp=4 tp_mode=2d", tuner.spec, "H100", world_size=8)
    assert tuner.prediction.step_time == expected.step_time
    assert {"tp_row", "tp_col"} <= set(tuner.prediction.comm_by_axis())
    assert "tp_mode=2d" in tuner.prediction_pane.value
    tuner.set(dp=1, tp=8, tp_mode="2.5d", tp_depth=2)
    assert tuner.plan == Plan(dp=1, tp=8, tp_mode="2.5d", tp_depth=2)
    assert tuner.prediction.comm_by_axis()["tp_dep"] > 0
    assert tuner.prediction.peak_bytes == predict(
        "dp=1 tp=8 tp_mode=2.5d tp_depth=2", tuner.spec, "H100").peak_bytes
    tuner.set(tp=8, tp_mode="2d", tp_depth=1)  # 8 is no q x q grid: Plan.validate's words
    assert tuner.prediction is None and "tp_mode=2d needs tp = q*q" in tuner.error


# ---- on a real pool -------------------------------------------------------------------------

@pytest.mark.engines
def test_measure_runs_the_plan_on_the_pool(shell):
    tuner = Tuner(SPEC, shell=shell, hardware="H100", plan="zero=2")
    assert tuner.world_size == 2
    tuner.measure_button.click()
    (trial,) = tuner.trials
    assert trial.ok, trial.error
    assert trial.plan == "dp=2 zero=2 fp32" and trial.measured_step_s > 0
    # memory is deterministic: the model's prediction within 10% of what the ranks held
    assert abs(trial.memory_error()) < 0.10, (trial.predicted_bytes, trial.measured_bytes)
    assert "dp=2 zero=2 fp32" in tuner.trials_pane.value
    shell.run_cell_magic("colossal", "--pull left", "left = [k for k in globals() "
                                                    "if k.startswith('_workbench')]")
    assert shell.user_ns["left"] == []  # the trial left nothing on the ranks


@pytest.mark.engines
def test_tensor_parallel_trial_is_predicted_with_the_tp_terms(shell):
    tuner = Tuner(SPEC, shell=shell, hardware="H100", plan="tp=2 sp_mode=split_gather")
    assert tuner.plan == Plan(dp=1, tp=2, sp_mode="split_gather")
    # one workload for every plan: dp=1 carries the 8 samples dp=2 would split
    assert tuner.prediction.setting.local_batch == 8
    assert tuner.prediction.comm_by_axis()["tp"] > 0
    tuner.measure_button.click()
    tuner.set("tp=2 sp_mode=none")
    tuner.measure_button.click()
    for trial in tuner.trials:
        assert trial.ok, trial.error
        # tp halves the split weights, split_gather the norms' activations: both as measured
        assert abs(trial.memory_error()) < 0.02, (trial.plan, trial.predicted_bytes,
                                                  trial.measured_bytes)
    assert [t.plan for t in tuner.trials] == ["dp=1 tp=2 sp_mode=split_gather zero=0 fp32",
                                              "dp=1 tp=2 zero=0 fp32"]


@pytest.mark.engines
def test_sequence_parallel_trials_are_predicted_with_the_sp_terms(shell):
    """Ulysses and ring on the sp axis: the trial runs them, and the prediction it is compared
    with (sequence split over sp, the runtime's attention, the sequence joined before the
    head) holds the measured memory. (A plan the runtime refuses becomes a row with its
    message: test_failed_trial_is_a_row_and_the_pool_still_works.)"""
    tuner = Tuner(SPEC, shell=shell, hardware="H100")
    for mode in ("all_to_all", "ring"):
        tuner.set(sp=2, sp_mode=mode)
        assert tuner.prediction is not None and tuner.prediction.comm_by_axis()["sp"] > 0
        tuner.measure_button.click()
        trial = tuner.trials[-1]
        assert trial.ok, trial.error
        assert abs(trial.memory_error()) < 0.02, (mode, trial.predicted_bytes,
                                                  trial.measured_bytes)
    assert "dp=1 sp=2 sp_mode=ring zero=0 fp32" in tuner.trials_pane.value


@pytest.mark.engines
def test_measure_invalid_plan_on_a_pool_sends_nothing(shell):
    tuner = Tuner(SPEC, shell=shell, hardware="H100")
    pool = tuner.pool
    tasks = len(pool.client.history)
    tuner.set(dp=4)
    tuner.measure_button.click()
    assert tuner.trials == [] and "invalid" in tuner.message
    assert len(pool.client.history) == tasks  # no engine was asked anything
    shell.run_cell_magic("colossal", "--pull w", "w = world_size")
    assert shell.user_ns["w"] == 2


@pytest.mark.engines
def test_failed_trial_is_a_row_and_the_pool_still_works(shell):
    tuner = Tuner({**SPEC, "model_type": "bert"}, shell=shell, hardware="H100")
    tuner.measure_button.click()
    (trial,) = tuner.trials
    assert not trial.ok and "model_type='bert'" in trial.error
    assert "failed" in tuner.message
    shell.run_cell_magic("colossal", "--pull s", "import torch\nt = torch.ones(1)\n"
                                                 "comm.all_reduce(t)\ns = t.item()")
    assert shell.user_ns["s"] == 2.0


@pytest.mark.engines
def test_use_this_plan_sets_the_default_of_later_cells(shell):
    from workbench.magics import active_magics

    magics = active_magics(shell)
    try:
        tuner = Tuner(SPEC, shell=shell, hardware="H100")
        tuner.set("zero=1 bf16 mb=2")
        tuner.use_button.click()
        assert magics.default_plan == Plan(zero_stage=1, precision="bf16", microbatches=2)
        shell.run_cell_magic("colossal", "--pull seen",
                             "seen = (plan.dp, plan.zero_stage, plan.precision, "
                             "plan.microbatches)")
        assert shell.user_ns["seen"] == (2, 1, "bf16", 2)
    finally:
        magics.default_plan = Plan()


@pytest.mark.engines
@pytest.mark.full  # 8 ranks
def test_grid_trials_are_rows_with_the_runtimes_answer():
    """2D and 2.5D plans on 8 ranks, predicted with the grid terms and sent to the ranks like
    any trial; both run, each held to the predicted memory (a refused plan's row and the pool
    staying usable after it: test_failed_trial_is_a_row_and_the_pool_still_works)."""
    from workbench.pool.pool import Pool

    with Pool(n=8) as pool:
        tuner = Tuner(GRID_SPEC, pool=pool, hardware="H100", plan="tp=8 tp_mode=2.5d tp_depth=2")
        assert tuner.prediction.comm_by_axis()["tp_dep"] > 0
        tuner.measure_button.click()
        tuner.set("dp=2 tp=4 tp_mode=2d")
        tuner.measure_button.click()
        deep, flat = tuner.trials
        assert (deep.plan, flat.plan) == ("dp=1 tp=8 tp_mode=2.5d tp_depth=2 zero=0 fp32",
                                          "dp=2 tp=4 tp_mode=2d zero=0 fp32")
        for trial, mode in ((deep, "2.5d"), (flat, "2d")):
            assert trial.ok, (mode, trial.error)  # both run on the 8 ranks
            # model states + activations as measured (2D: -0.6% when written)
            assert abs(trial.memory_error()) < 0.02, (mode, trial.predicted_bytes,
                                                      trial.measured_bytes)

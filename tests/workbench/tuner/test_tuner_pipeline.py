"""The plan tuner's pipeline controls: stages, schedule, chunks and micro-batches.

What is protected: moving the pp, pp_schedule, pp_chunks and microbatches controls predicts
the pipeline (its bubble and the largest stage's memory in the pane) exactly as ``predict``
does; combinations a pipeline refuses show ``Plan.validate``'s words; and on a real 2-rank
pool a pp=2 trial trains through the pipeline schedule (1F1B, then GPipe), with each stage's
model states and activations held to the prediction of the largest stage, and its measured
step time set beside the predicted one (not asserted: times on shared CPUs are noise).
"""

from __future__ import annotations

import html

import pytest

from kernels_runtime.mesh.plan import Plan, PlanError
from workbench.planner import ModelSpec, predict
from workbench.tuner import Tuner

SPEC = dict(hidden=64, layers=2, heads=2, vocab=256, seq=64, batch=4, model_type="gpt2",
            positions=64, activation="gelu_new", attention="sdpa")
DEEP = {**SPEC, "layers": 4}  # room for 2 stages x 2 chunks


def test_pipeline_controls_drive_the_prediction():
    tuner = Tuner(DEEP, world_size=2, hardware="H100")
    tuner.set(pp=2, microbatches=4)
    assert tuner.error is None and tuner.plan == Plan(dp=1, pp=2, microbatches=4)
    for schedule, chunks in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zbv", 1)):
        tuner.set(pp_schedule=schedule, pp_chunks=chunks)
        assert tuner.error is None, tuner.error
        expected = predict(tuner.plan, tuner.spec, "H100", world_size=2)
        got = tuner.prediction
        assert got.pipeline is not None and got.pipeline.schedule == schedule
        assert got.step_time == expected.step_time and got.peak_bytes == expected.peak_bytes
        pane = tuner.prediction_pane.value
        assert "pipeline bubble" in pane and f"<b>{schedule}</b> over 2 stages" in pane
    tuner.set(pp=1, pp_schedule="1f1b", pp_chunks=1)
    assert tuner.prediction.pipeline is None
    assert "pipeline" not in tuner.prediction_pane.value  # no bubble column, no pipeline line


@pytest.mark.parametrize("values", [
    {"pp": 2, "microbatches": 1},
    {"pp": 2, "microbatches": 4, "pp_chunks": 2},
    {"pp": 2, "microbatches": 4, "pp_schedule": "interleaved"},
    {"pp": 2, "microbatches": 4, "pp_schedule": "interleaved", "pp_chunks": 4},
])
def test_refused_pipelines_show_plan_validate_text(values):
    tuner = Tuner(DEEP, world_size=2, hardware="H100")
    tuner.set(**values)
    with pytest.raises(PlanError) as expected:
        Plan(**tuner.values).validate(2, ModelSpec.from_config(DEEP).plan_config())
    assert tuner.error == str(expected.value) and tuner.prediction is None
    assert html.escape(str(expected.value)) in tuner.prediction_pane.value


# ---- on a real pool -------------------------------------------------------------------------

@pytest.mark.engines
def test_pipeline_trial_trains_on_two_ranks(shell):
    """pp=2 on the 2-rank pool: each rank is one stage of GPT-2's two blocks; the trial runs
    the schedule through train_step and its largest stage holds what was predicted."""
    tuner = Tuner(SPEC, shell=shell, hardware="H100")
    tuner.set(pp=2, microbatches=2)
    assert tuner.plan == Plan(dp=1, pp=2, microbatches=2)
    tuner.measure_button.click()
    tuner.set(pp_schedule="gpipe", microbatches=4)
    tuner.measure_button.click()
    flat, gpipe = tuner.trials
    assert [t.plan for t in tuner.trials] == ["dp=1 pp=2 schedule=1f1b zero=0 fp32 mb=2",
                                              "dp=1 pp=2 schedule=gpipe zero=0 fp32 mb=4"]
    for trial in (flat, gpipe):
        assert trial.ok, trial.error
        assert trial.measured_step_s > 0 and trial.time_error() is not None
        # stage memory is deterministic: within 2% of the largest stage's prediction
        assert abs(trial.memory_error()) < 0.02, (trial.plan, trial.predicted_bytes,
                                                  trial.measured_bytes)
    # GPipe keeps all 4 micro-batches on the last stage (logits included); 1F1B two at most
    assert gpipe.measured_bytes > flat.measured_bytes
    assert "schedule=gpipe" in tuner.trials_pane.value

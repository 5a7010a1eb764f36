"""The plan tuner on a mixture of experts: the ep control, Recommend choosing ep, an ep trial.

What is protected: the ep control reaches the cost model's expert terms (the prediction is
``predict``'s, with the ep axis's all-to-alls); Recommend on a Mixtral-shaped model at a budget
only ep fits moves the controls to an ep plan and says why; and on a real 2-rank pool an
``ep=2`` trial trains a Mixtral built from the same description (the trial's model has the
planner's parameter count), its model states + activations within 2% of the prediction
and below the dp=2 trial's (half the experts per rank). Step
times are shown, not asserted: times on shared CPUs are noise.
"""

from __future__ import annotations

import pytest

from kernels_runtime.mesh.plan import Plan
from workbench.planner import ModelSpec, predict, recommend
from workbench.planner.cost_model import plan_label
from workbench.tuner import Tuner

# Mixtral's layout: 4 experts of width 96, top-2; 5 heads and one block, so tp and pp cannot
# split it on 2 ranks and only ep divides the experts
MOE = dict(hidden=80, layers=1, heads=5, kv_heads=5, vocab=256, seq=32, batch=4, ffn=96,
           model_type="mixtral", activation="silu", attention="sdpa", tied_embeddings=False,
           experts=4, top_k=2)


def test_the_ep_control_predicts_with_the_expert_terms():
    tuner = Tuner(MOE, world_size=2, hardware="H100")
    tuner.set(ep=2)
    assert tuner.error is None and tuner.plan == Plan(dp=2, ep=2)
    expected = predict("dp=2 ep=2", tuner.spec, "H100", world_size=2)
    assert tuner.prediction.step_time == expected.step_time
    assert tuner.prediction.peak_bytes == expected.peak_bytes
    assert tuner.prediction.comm_by_axis()["ep"] > 0 and "ep=2" in tuner.prediction_pane.value
    tuner.set(ep=3)  # Plan.validate's words
    assert tuner.prediction is None and "ep=3 does not divide dp=2" in tuner.error


def test_recommend_moves_the_ep_control_when_only_ep_fits():
    spec = ModelSpec.from_config(MOE)
    every = recommend(spec, 2, 1e15, "H100", precisions=("fp32", "bf16", "fp16"))
    need = min(p.peak_bytes for p in every.ranked if p.plan.ep > 1)
    assert need < min(p.peak_bytes for p in every.ranked if p.plan.ep == 1)
    tuner = Tuner(MOE, world_size=2, hardware="H100", memory_budget=need * 1.001)
    tuner.recommend_button.click()
    assert tuner.plan is not None and tuner.plan.ep == 2
    assert tuner.controls["ep"].value == 2
    assert plan_label(tuner.plan) in tuner.message
    assert "ep=2 holds 2 of 4 experts per block" in tuner.message


# ---- on a real pool -------------------------------------------------------------------------

@pytest.mark.engines
def test_expert_parallel_trial_trains_on_two_ranks(shell):
    from kernels_runtime.calibrate.trial import build_model

    spec = ModelSpec.from_config(MOE)
    assert sum(p.numel() for p in build_model(MOE).parameters()) == spec.param_count
    tuner = Tuner(MOE, shell=shell, hardware="H100")
    tuner.set(ep=2)
    tuner.measure_button.click()
    tuner.set(ep=1)
    tuner.measure_button.click()
    ep, dp = tuner.trials
    assert (ep.plan, dp.plan) == ("dp=2 ep=2 zero=0 fp32", "dp=2 zero=0 fp32")
    for trial in (ep, dp):
        assert trial.ok, trial.error
        assert trial.measured_step_s > 0 and trial.time_error() is not None
        assert abs(trial.memory_error()) < 0.02, (trial.plan, trial.predicted_bytes,
                                                  trial.measured_bytes)
    assert ep.measured_bytes < dp.measured_bytes  # two of the four experts per rank
    assert "dp=2 ep=2 zero=0 fp32" in tuner.trials_pane.value

"""Plan tuner, notebook side: predict what a parallel plan costs, and recommend one.

- ``predict(plan, model, hardware)``: peak memory per rank and tier (parameters, gradients,
  optimizer states, activations, buffers) and step time (compute, communication with overlap,
  optimizer, overhead, pipeline bubble) of dp/ZeRO, 1D tensor, 2D / 2.5D grid,
  sequence-parallel and pipeline plans (gpipe, 1f1b, interleaved, zbv), from formulas checked
  against ``shared/REFERENCES.md``.
- ``recommend(model, world_size, memory_budget_bytes, hardware)``: the fastest runnable plan
  within the budget, with the reasons in words.
- ``PROFILES`` (A100, H100, H200 nodes) and ``calibrate(pool)`` / ``calibrate_ranks(world)``,
  which measure the live machine on real ranks.

Everything but calibration is plain arithmetic: no torch, so a notebook can plan a cluster it
does not have.
"""

from workbench.planner.calibration import calibrate, calibrate_ranks
from workbench.planner.cost_model import Prediction, predict
from workbench.planner.hardware import PROFILES, HardwareProfile, Link, Overhead, get_profile
from workbench.planner.recommend import NoPlanFitsError, Recommendation, recommend
from workbench.planner.spec import ModelSpec

__all__ = ["PROFILES", "HardwareProfile", "Link", "ModelSpec", "NoPlanFitsError", "Overhead",
           "Prediction", "Recommendation", "calibrate", "calibrate_ranks", "get_profile",
           "predict", "recommend"]

"""Pipeline parallelism: stages from the policy's split points (``partition.py``,
``applier.py``, ``stage.py``) and the schedules ``train_step`` runs in place of the sequential
one: GPipe, 1F1B, interleaved and zero-bubble V (``schedules.py`` orders the work,
``executor.py`` runs it, ``p2p.py`` carries activations and gradients between neighbours,
``weight_grad.py`` defers zbv's weight gradients, ``simulate.py`` replays a schedule's timing
for the planner)."""

from kernels_runtime.parallel.pipeline.schedules import build as build_schedule
from kernels_runtime.parallel.pipeline.simulate import bubble_formula, replay

__all__ = ["bubble_formula", "build_schedule", "replay"]  # the torch-free schedule tools

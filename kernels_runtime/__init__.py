"""Engine-side parallel runtime of colossal-workbench.

Everything here runs inside a rank: an ipyparallel engine driven from a notebook, or a plain
``torchrun`` process. It never imports IPython or widgets, so the same code trains from a script::

    from kernels_runtime import ParallelContext, parallelize, train_step

The public names below are loaded on first use (PEP 562), so importing the package, or one of
its torch-free modules (``kernels_runtime.mesh.plan``, ``kernels_runtime.telemetry``) as the
notebook side does, does not import torch.
"""

from __future__ import annotations

from kernels_runtime._lazy import lazy_module as _lazy_module

__version__ = "0.1.0"

_PUBLIC = {
    "parallelize": "kernels_runtime.api",
    "parallelize_model": "kernels_runtime.api",
    "train_step": "kernels_runtime.api",
    "eval_step": "kernels_runtime.api",
    "causal_lm_loss": "kernels_runtime.api",
    "Objective": "kernels_runtime.api",
    "StepResult": "kernels_runtime.api",
    "BoostedOptimizer": "kernels_runtime.optim",
    "Plan": "kernels_runtime.mesh.plan",
    "PlanError": "kernels_runtime.mesh.plan",
    "ParallelContext": "kernels_runtime.mesh.context",
    "RankSession": "kernels_runtime.session",
    "save": "kernels_runtime.checkpoint",
    "load": "kernels_runtime.checkpoint",
    "save_model": "kernels_runtime.checkpoint",
    "load_model": "kernels_runtime.checkpoint",
    "export_hf": "kernels_runtime.checkpoint",
    "load_pretrained": "kernels_runtime.checkpoint.pretrained",
    "load_pretrained_for_training": "kernels_runtime.checkpoint.pretrained",
    "CheckpointError": "kernels_runtime.checkpoint",
    "get_policy": "kernels_runtime.policies",
    "register_policy": "kernels_runtime.policies",
    "deferred_parameters": "kernels_runtime.deferred_params",
    "evaluate": "kernels_runtime.api",
    "fit": "kernels_runtime.api",
    "BudgetError": "kernels_runtime.memory.placement",
}

__all__ = sorted(_PUBLIC)

__getattr__, __dir__ = _lazy_module(_PUBLIC, globals())

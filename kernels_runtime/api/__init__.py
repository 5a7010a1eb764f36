"""The runtime's user surface: ``parallelize``, ``BoostedOptimizer``, ``train_step``."""

from kernels_runtime.api.optimizer import BoostedOptimizer
from kernels_runtime.api.parallelize import parallelize, sync_module_states
from kernels_runtime.api.train import StepResult, causal_lm_loss, train_step

__all__ = ["BoostedOptimizer", "StepResult", "causal_lm_loss", "parallelize",
           "sync_module_states", "train_step"]

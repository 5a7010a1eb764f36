"""The runtime's user surface: ``parallelize_model`` / ``parallelize`` (ordered appliers) and
``train_step`` (runs a schedule over an objective); ``evaluate`` and ``fit``, the loops around
``eval_step`` and ``train_step``."""

from kernels_runtime.api.loops import History, evaluate, fit
from kernels_runtime.api.objective import Objective, causal_lm_loss, next_token_loss
from kernels_runtime.api.parallelize import APPLIERS, parallelize, parallelize_model
from kernels_runtime.api.schedule import Schedule, SequentialSchedule, to_device
from kernels_runtime.api.train import StepResult, eval_step, train_step
from kernels_runtime.optim import BoostedOptimizer
from kernels_runtime.parallel.data.applier import sync_module_states

__all__ = ["APPLIERS", "BoostedOptimizer", "Objective", "Schedule", "SequentialSchedule",
           "StepResult", "causal_lm_loss", "eval_step", "next_token_loss", "parallelize",
           "parallelize_model", "sync_module_states", "to_device", "train_step",
           "History", "evaluate", "fit"]

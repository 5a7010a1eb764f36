"""The boosted optimizer: fp32 masters, loss scaling, global-norm clipping over every axis, and
the ``GradSync`` seam through which each data-parallel strategy plugs into one step."""

from kernels_runtime.optim.boosted import BoostedOptimizer
from kernels_runtime.optim.norm import any_rank_overflowed, global_grad_norm
from kernels_runtime.optim.rebuild import (
    ELEMENTWISE_OPTIMIZERS,
    check_elementwise,
    optimizer_state_tensors,
    rebuild_optimizer,
    tensor_bytes,
)
from kernels_runtime.optim.state import PARAM, ModelState, StatePiece
from kernels_runtime.optim.sync import GradShard, GradSync

__all__ = ["ELEMENTWISE_OPTIMIZERS", "PARAM", "BoostedOptimizer", "GradShard", "GradSync",
           "ModelState", "StatePiece", "any_rank_overflowed", "check_elementwise",
           "global_grad_norm", "optimizer_state_tensors", "rebuild_optimizer", "tensor_bytes"]

"""The tensor-parallel applier (first in ``parallelize``'s order)."""

from __future__ import annotations

from torch import nn

from kernels_runtime.parallel.state import ParallelState, not_available


def check(state: ParallelState) -> str | None:
    tp = state.ctx.plan.tp
    return not_available(f"tensor parallelism (tp={tp})") if tp > 1 else None


def apply(model: nn.Module, state: ParallelState) -> nn.Module:
    return model  # tp == 1: every parameter stays whole (the default layout)

"""The tensor-parallel applier (first in ``parallelize``'s order)."""

from __future__ import annotations

from torch import nn

from kernels_runtime.parallel.state import ParallelState


def check(state: ParallelState) -> str | None:
    tp = state.ctx.plan.tp
    if tp > 1:
        return (f"tensor parallelism (tp={tp}) is not available yet; use dp and zero "
                "(e.g. \"dp=2 zero=2\")")
    return None


def apply(model: nn.Module, state: ParallelState) -> nn.Module:
    return model  # tp == 1: every parameter stays whole (the default layout)

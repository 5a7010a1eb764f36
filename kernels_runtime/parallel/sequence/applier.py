"""The sequence-parallel applier (second in ``parallelize``'s order)."""

from __future__ import annotations

from torch import nn

from kernels_runtime.parallel.state import ParallelState


def check(state: ParallelState) -> str | None:
    sp = state.ctx.plan.sp
    if sp > 1:
        return (f"sequence parallelism (sp={sp}) is not available yet; use dp and zero "
                "(e.g. \"dp=2 zero=2\")")
    return None


def apply(model: nn.Module, state: ParallelState) -> nn.Module:
    return model

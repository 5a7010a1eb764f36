"""The sequence-parallel applier (second in ``parallelize``'s order)."""

from __future__ import annotations

from torch import nn

from kernels_runtime.parallel.state import ParallelState, not_available


def check(state: ParallelState, model: nn.Module) -> str | None:
    sp = state.ctx.plan.sp
    return not_available(f"sequence parallelism (sp={sp})") if sp > 1 else None


def apply(model: nn.Module, state: ParallelState) -> nn.Module:
    return model

"""The pipeline applier (after activation checkpointing, before data parallelism)."""

from __future__ import annotations

from torch import nn

from kernels_runtime.parallel.state import ParallelState


def check(state: ParallelState) -> str | None:
    pp = state.ctx.plan.pp
    if pp > 1:
        return (f"pipeline parallelism (pp={pp}) is not available yet; use dp and zero "
                "(e.g. \"dp=2 zero=2\")")
    return None


def apply(model: nn.Module, state: ParallelState) -> nn.Module:
    return model

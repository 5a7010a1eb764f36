"""The pipeline applier (after activation checkpointing, before data parallelism)."""

from __future__ import annotations

from torch import nn

from kernels_runtime.parallel.state import ParallelState, not_available


def check(state: ParallelState, model: nn.Module) -> str | None:
    pp = state.ctx.plan.pp
    return not_available(f"pipeline parallelism (pp={pp})") if pp > 1 else None


def apply(model: nn.Module, state: ParallelState) -> nn.Module:
    return model

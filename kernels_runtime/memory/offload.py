"""The offload applier (last in ``parallelize``'s order): placement of model-state chunks on
device, host or disk. Plans with offload other than none are refused until placement lands."""

from __future__ import annotations

from torch import nn

from kernels_runtime.parallel.state import ParallelState


def check(state: ParallelState, model: nn.Module) -> str | None:
    offload = state.ctx.plan.offload
    if offload != "none":
        return (f"offload={offload} is not available yet; every state stays on the device "
                "(remove offload from the plan)")
    return None


def apply(model: nn.Module, state: ParallelState) -> nn.Module:
    return model

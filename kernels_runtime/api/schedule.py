"""How a step's micro-batches run through the model: the schedule ``train_step`` hands them to.

Without pipeline parallelism every rank runs the micro-batches one after another, forward
then backward, communicating gradients only after the last (``SequentialSchedule``). A pipeline
interleaves micro-batches across stages instead (its schedules live in
``kernels_runtime.parallel.pipeline`` and are recorded in the model's ``ParallelState``); both
present the same ``run``, so ``train_step`` is one loop for every plan.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from kernels_runtime.comm.accelerator import to_device
from kernels_runtime.optim import BoostedOptimizer
from kernels_runtime.telemetry import Telemetry

LossFn = Callable[[nn.Module, Any], torch.Tensor]


class Schedule(Protocol):
    def run(self, model: nn.Module, optimizer: BoostedOptimizer, microbatches: Sequence[Any],
            objective: LossFn, telemetry: Telemetry) -> torch.Tensor:
        """Forward and backward every micro-batch; return the sum of their losses (a detached
        fp32 scalar on the rank's device) without waiting for the device."""
        ...


class SequentialSchedule:
    """Micro-batches one after another; each loss divided by their number so the gradient is
    the mean over the local batch (the data-parallel mean happens in the reduction)."""

    def run(self, model: nn.Module, optimizer: BoostedOptimizer, microbatches: Sequence[Any],
            objective: LossFn, telemetry: Telemetry) -> torch.Tensor:
        n = len(microbatches)
        total = torch.zeros((), dtype=torch.float32, device=optimizer.ctx.device)
        for i, batch in enumerate(microbatches):
            batch = to_device(batch, optimizer.ctx.device)
            sync = contextlib.nullcontext() if i == n - 1 else optimizer.no_sync()
            with sync, telemetry.compute(), optimizer.sync.micro_batch():
                loss = objective(model, batch)
                optimizer.backward(loss / n)
            total += loss.detach().float()  # stays on the device: no host sync per micro-batch
        return total

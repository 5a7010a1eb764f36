"""``train_step``: micro-batches, gradient accumulation and the optimizer step in one call."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kernels_runtime.api.optimizer import BoostedOptimizer

LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass
class StepResult:
    loss: float  # mean over micro-batches and data-parallel ranks
    stepped: bool  # False when fp16 overflow skipped the step
    grad_norm: float | None


def causal_lm_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Loss of an HF-style model on ``(input_ids, labels)`` or a dict of model inputs."""
    if isinstance(batch, dict):
        return model(**batch).loss
    input_ids, labels = batch
    out = model(input_ids=input_ids, labels=labels)
    return out.loss if hasattr(out, "loss") else out


def train_step(
    model: nn.Module,
    optimizer: BoostedOptimizer,
    microbatches: Sequence[Any],
    loss_fn: LossFn = causal_lm_loss,
) -> StepResult:
    """Forward and backward every micro-batch (communicating only after the last), then step.

    Each micro-batch loss is divided by their number so the gradient is the mean over the
    whole local batch; the data-parallel average happens in the gradient reduction.
    """
    n = len(microbatches)
    if n == 0:
        raise ValueError("train_step needs at least one micro-batch")
    total = torch.zeros((), dtype=torch.float32)
    for i, batch in enumerate(microbatches):
        sync = contextlib.nullcontext() if i == n - 1 else optimizer.no_sync()
        with sync:
            loss = loss_fn(model, batch)
            optimizer.backward(loss / n)
        total += loss.detach().float().cpu()
    stepped = optimizer.step()
    mean = (total / n).to(optimizer.ctx.device)
    optimizer.ctx.comm.all_reduce(mean, group=optimizer.ctx.dp_group)
    return StepResult(mean.item() / optimizer.ctx.dp_size, stepped, optimizer.last_grad_norm)

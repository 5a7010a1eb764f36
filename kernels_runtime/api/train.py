"""``train_step``: micro-batches, gradient accumulation and the optimizer step in one call.

Every step is recorded in the telemetry of the optimizer's context (``ctx.telemetry``): tokens
and samples counted from the micro-batches, model FLOPs estimated from the parameter count, and
the step time split into compute (forward/backward and the optimizer step, marked as compute
regions), communication and waiting (definitions in ``kernels_runtime.telemetry.split``).
"""

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
    telemetry = optimizer.ctx.telemetry
    samples, tokens, seq_len = _count(microbatches)
    flops = telemetry.model_flops(model, tokens, seq_len)
    with telemetry.step(tokens=tokens, samples=samples, flops=flops):
        total = torch.zeros((), dtype=torch.float32)
        for i, batch in enumerate(microbatches):
            batch = to_device(batch, optimizer.ctx.device)
            sync = contextlib.nullcontext() if i == n - 1 else optimizer.no_sync()
            with sync, telemetry.compute():
                loss = loss_fn(model, batch)
                optimizer.backward(loss / n)
            total += loss.detach().float().cpu()
        with telemetry.compute():
            stepped = optimizer.step()
        mean = (total / n).to(optimizer.ctx.device)
        optimizer.ctx.comm.all_reduce(mean, group=optimizer.ctx.dp_group)
        loss_value = mean.item() / optimizer.ctx.dp_size
    return StepResult(loss_value, stepped, optimizer.last_grad_norm)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor on ``device`` (tuples, lists, named tuples and dicts kept):
    data loaders yield host tensors, the model lives on the rank's GPU. A no-op on CPU ranks."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return type(batch)((k, to_device(v, device)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def _count(microbatches: Sequence[Any]) -> tuple[int, int, int | None]:
    """(samples, tokens, sequence length) of this rank's micro-batches.

    Read from ``input_ids`` (a dict batch) or the first element (an ``(input_ids, labels)``
    batch): samples are its leading dimension, tokens its element count when it holds integer
    token ids. Batches of floats (pixels) count samples only."""
    samples = tokens = 0
    seq_len = None
    for batch in microbatches:
        if isinstance(batch, dict):
            first = batch.get("input_ids")
            if first is None:
                first = next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
        elif isinstance(batch, (tuple, list)):
            first = batch[0] if batch else None
        else:
            first = batch
        if not isinstance(first, torch.Tensor) or first.dim() == 0:
            continue
        samples += first.shape[0]
        if not first.is_floating_point():
            tokens += first.numel()
            seq_len = first.shape[-1] if first.dim() >= 2 else seq_len
    return samples, tokens, seq_len

"""``train_step``: micro-batches, gradient accumulation and the optimizer step in one call.

The micro-batches run through the model's schedule (``schedule.py``: in sequence, or a
pipeline's); then the optimizer steps and the loss is averaged over data-parallel ranks, the
one host synchronization of the step. Every step is recorded in the telemetry of the
optimizer's context (``ctx.telemetry``): tokens and samples counted from the micro-batches,
model FLOPs estimated from the parameter count, and the step time split into compute,
communication and waiting (measured blocking: receives, barriers, late peers; definitions in
``kernels_runtime.telemetry.split``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kernels_runtime.api.interrupts import STOPPED, held_interrupts
from kernels_runtime.api.objective import causal_lm_loss
from kernels_runtime.api.schedule import LossFn, Schedule, SequentialSchedule, to_device
from kernels_runtime.optim import BoostedOptimizer
from kernels_runtime.parallel.state import parallel_state


@dataclass
class StepResult:
    loss: float  # mean over micro-batches and data-parallel ranks
    stepped: bool  # False when fp16 overflow skipped the step
    grad_norm: float | None


def train_step(
    model: nn.Module,
    optimizer: BoostedOptimizer,
    microbatches: Sequence[Any],
    loss_fn: LossFn = causal_lm_loss,
    *,
    schedule: Schedule | None = None,
) -> StepResult:
    """Forward and backward every micro-batch (communicating only after the last), then step.

    ``loss_fn(model, batch)`` returns the micro-batch's loss: an ``Objective`` (forward and
    loss apart, as pipelines need) or any callable. ``schedule`` defaults to the model's
    (``model.parallel_state.schedule``), else micro-batches in sequence.
    """
    n = len(microbatches)
    if n == 0:
        raise ValueError("train_step needs at least one micro-batch")
    if schedule is None:
        state = parallel_state(model)
        schedule = state.schedule if state is not None and state.schedule is not None \
            else SequentialSchedule()
    ctx = optimizer.ctx
    telemetry = ctx.telemetry
    samples, tokens, seq_len = _count(microbatches)
    flops = telemetry.model_flops(model, tokens, seq_len)
    with telemetry.step(tokens=tokens, samples=samples, flops=flops):
        with held_interrupts() as interrupts:  # a step is applied whole or not at all
            total = schedule.run(model, optimizer, microbatches, loss_fn, telemetry)
            with telemetry.compute():
                stepped = optimizer.step()
        mean = total / n
        ctx.comm.all_reduce(mean, group=ctx.dp_group)
        result = StepResult(mean.item() / ctx.dp_size, stepped, optimizer.last_grad_norm)
        # published with this step's telemetry: host values, no more syncs
        telemetry.record_train(result.loss, result.stepped, result.grad_norm,
                               *_lr_and_scale(optimizer))
    if interrupts:  # the step is applied and counted on this rank: stop after it
        raise KeyboardInterrupt(STOPPED)
    return result


def eval_step(model: nn.Module, microbatches: Sequence[Any],
              loss_fn: LossFn = causal_lm_loss) -> float:
    """The mean loss over the micro-batches and data-parallel ranks, without gradients.

    The same call on every rank under any plan, as ``train_step``: a pipeline runs its
    forward-only schedule (each stage its chunks, the loss on the last stage, summed to every
    rank); otherwise the micro-batches run in sequence. For a model from ``parallelize`` or
    ``parallelize_model``."""
    state = parallel_state(model)
    if state is None:
        raise ValueError("eval_step takes a model returned by parallelize or parallelize_model; "
                         "for a plain model call loss_fn(model, batch) under torch.no_grad()")
    if not microbatches:
        raise ValueError("eval_step needs at least one micro-batch")
    ctx = state.ctx.fold_sp()
    if state.schedule is not None:
        total = state.schedule.evaluate(model, microbatches, loss_fn, ctx.telemetry)
    else:
        total = torch.zeros((), dtype=torch.float32, device=ctx.device)
        with torch.no_grad():
            for batch in microbatches:
                total += loss_fn(model, to_device(batch, ctx.device)).detach().float()
    mean = total / len(microbatches)
    ctx.comm.all_reduce(mean, group=ctx.dp_group)
    loss = mean.item() / ctx.dp_size
    ctx.telemetry.record_eval(loss)  # the eval loss curve, published with the telemetry
    ctx.telemetry.maybe_publish()
    return loss


def _lr_and_scale(optimizer: BoostedOptimizer) -> tuple[float | None, float | None]:
    """The first parameter group's learning rate and the fp16 loss scale (None without
    one): Python floats already on the host, for the training curves."""
    groups = optimizer.param_groups
    lr = groups[0].get("lr") if groups else None
    scaler = getattr(optimizer, "scaler", None)
    scale = scaler.scale if getattr(optimizer, "precision", None) == "fp16" else None
    return (float(lr) if isinstance(lr, (int, float)) else None,
            float(scale) if scale is not None else None)


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

"""``evaluate`` and ``fit``: the loops around ``eval_step`` and ``train_step`` a fine-tune needs.

``evaluate`` reports the held-out loss weighted by tokens, as one process would compute it over
the whole set: the sum of every counted token's loss over their number, whatever the padding,
the micro-batch sizes or the plan. ``eval_step`` returns a mean over micro-batches and dp ranks,
so the objective is wrapped to return each micro-batch's loss times its counted tokens; that
mean times (micro-batches x data ranks) is then the sum, and one all-reduce of the token counts
gives the divisor. Micro-batches without a counted token (the filler rows that even out ranks,
``data.files.eval_batches``) add nothing, though a model's mean over zero tokens is NaN.

Both loops draw a progress bar (``tqdm.auto``: a widget in a notebook kernel, text on an
engine's stderr, which the workbench shows under the cell) on global rank 0 only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kernels_runtime.api.objective import Objective, causal_lm_loss
from kernels_runtime.api.schedule import LossFn
from kernels_runtime.api.train import eval_step, train_step
from kernels_runtime.data.packing import counted_tokens
from kernels_runtime.optim import BoostedOptimizer
from kernels_runtime.parallel.state import parallel_state


def _progress(total: int | None, desc: str, show: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not show, dynamic_ncols=True)


def _token_weighted(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` times the batch's counted tokens (0 for a batch without any)."""
    def weigh(loss: torch.Tensor, batch: Any) -> torch.Tensor:
        n = counted_tokens(batch)
        return loss * n if n else torch.zeros_like(loss)

    if isinstance(loss_fn, Objective):  # keep forward and loss apart for a pipeline
        inner = loss_fn.loss
        return Objective(forward=loss_fn.forward,
                         loss=lambda output, batch: weigh(inner(output, batch), batch))
    return lambda model, batch: weigh(loss_fn(model, batch), batch)


def evaluate(model: nn.Module, batches: Iterable[Any], loss_fn: LossFn = causal_lm_loss, *,
             per_call: int | None = None, progress: bool = True,
             desc: str = "eval") -> dict[str, Any]:
    """Token-weighted loss and perplexity of ``model`` over a held-out set:
    ``{"loss": float, "perplexity": float, "tokens": int}`` (tokens counted over the whole
    set), the same on every rank.

    Collective: every rank calls it with its own share of the set (``batches``: micro-batches
    as ``train_step`` takes them, dicts or ``(input_ids, labels)``; each dp rank the same number,
    as ``data.files.eval_batches`` gives them). ``loss_fn`` must return the mean loss over a
    micro-batch's counted tokens (labels after the first position that are not ``-100``), as
    ``causal_lm_loss`` and ``next_token_loss`` do. ``per_call`` micro-batches go to each
    ``eval_step`` (default: the pipeline degree, so a pipeline keeps its stages busy)."""
    state = parallel_state(model)
    if state is None:
        raise ValueError("evaluate takes a model returned by parallelize or parallelize_model")
    batches = list(batches)
    ctx = state.ctx.fold_sp()  # the data ranks eval_step averages over
    per_call = per_call or max(1, ctx.size("pp"))
    device = ctx.device
    # counts checked equal on every data rank first: a rank with fewer batches would hang
    local = torch.tensor([sum(counted_tokens(b) for b in batches), len(batches),
                          len(batches) ** 2], dtype=torch.long, device=device)
    ctx.comm.all_reduce(local, group=ctx.dp_group)
    tokens, n_sum, n_sq = local.tolist()
    if n_sq * ctx.dp_size != n_sum ** 2:
        raise ValueError(f"evaluate got {len(batches)} micro-batches on rank {ctx.rank} but "
                         "another data rank got a different number; give every dp rank the "
                         "same count (data.files.eval_batches evens them with filler rows)")
    weighted = _token_weighted(loss_fn)
    total = 0.0  # sum over the set of loss x tokens (x sp: each sp rank counts its batch)
    bar = _progress(len(batches), desc, ctx.rank == 0 and progress)
    for i in range(0, len(batches), per_call):
        chunk = batches[i:i + per_call]
        total += eval_step(model, chunk, weighted) * len(chunk) * ctx.dp_size
        bar.update(len(chunk))
    loss = total / tokens if tokens else math.nan
    bar.set_postfix(loss=f"{loss:.4f}")  # a running value would need a reduction per chunk
    bar.close()
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)),
            "tokens": tokens // ctx.sp_folded}


@dataclass
class History:
    """What ``fit`` measured: one dict per step (``step``, ``loss``, ``lr``, ``grad_norm``,
    ``stepped``) and one per evaluation (``step`` and ``evaluate``'s result)."""

    train: list[dict[str, Any]] = field(default_factory=list)
    eval: list[dict[str, Any]] = field(default_factory=list)


def fit(model: nn.Module, optimizer: BoostedOptimizer, batches: Iterable[Any], *,
        steps: int, accumulate: int = 1, scheduler: Any = None,
        loss_fn: LossFn = causal_lm_loss, eval_batches: Iterable[Any] | None = None,
        eval_every: int | None = None, progress: bool = True) -> History:
    """Train for ``steps`` optimizer steps and return the ``History``.

    Collective, like ``train_step``. Each step takes ``accumulate`` micro-batches from
    ``batches`` (an iterator of this rank's micro-batches, e.g. ``data.files.train_batches``),
    runs ``train_step`` and then ``scheduler.step()`` (any ``torch.optim.lr_scheduler``, e.g.
    transformers' ``get_scheduler("cosine", optimizer=optimizer, ...)``, built on the returned
    optimizer or on the one given to ``parallelize``; not after a step fp16 overflow skipped). With
    ``eval_batches``, ``evaluate`` runs every ``eval_every`` steps (default: once, at the end)
    and after the last step. The rank-0 progress bar shows the loss and learning rate."""
    if steps < 1 or accumulate < 1:
        raise ValueError(f"steps and accumulate must be >= 1, got {steps=}, {accumulate=}")
    held_out = list(eval_batches) if eval_batches is not None else None
    every = eval_every or steps
    stream: Iterator[Any] = iter(batches)
    history = History()
    bar = _progress(steps, "train", optimizer.ctx.rank == 0 and progress)
    for step in range(1, steps + 1):
        micro = [next(stream, None) for _ in range(accumulate)]
        if any(b is None for b in micro):
            bar.close()
            raise ValueError(f"batches ran out at step {step} of {steps}; pass more data or "
                             "an endless stream (data.files.train_batches with epochs=None)")
        lr = optimizer.param_groups[0]["lr"]  # the rate this step uses
        result = train_step(model, optimizer, micro, loss_fn)
        if scheduler is not None and result.stepped:  # an fp16 overflow's skip keeps the rate
            scheduler.step()
        history.train.append({"step": step, "loss": result.loss, "lr": float(lr),
                              "grad_norm": result.grad_norm, "stepped": result.stepped})
        bar.update(1)
        bar.set_postfix(loss=f"{result.loss:.4f}", lr=f"{float(lr):.2e}")
        if held_out is not None and (step % every == 0 or step == steps):
            metrics = evaluate(model, held_out, loss_fn, progress=False)
            history.eval.append({"step": step, **metrics})
            if not bar.disable:
                bar.write(f"step {step}: eval loss {metrics['loss']:.4f}, "
                          f"perplexity {metrics['perplexity']:.2f}")
    bar.close()
    return history

"""Cross-entropy on vocabulary-parallel logits, without ever gathering the full logits.

Each rank holds logits for its slice of the vocabulary, (n, V/tp): gathering (n, V) would
cost the memory tensor parallelism saved (V = 50257 for GPT-2). The loss needs three numbers
per row, each one all-reduce over tp (Megatron-LM's vocab-parallel cross-entropy): the row's
maximum (for a stable softmax), the sum of exponentials, and the target's logit (held by the
one rank whose slice contains it). The gradient is the local softmax minus one at the target,
computed from what forward kept. Padded vocabulary columns (``held`` < the slice width) never
take part; targets equal to ``ignore_index`` count neither in the loss nor in the mean.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kernels_runtime.comm import Collectives


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int, held: int,
                comm: Collectives, group, ignore_index: int) -> torch.Tensor:
        ctx.dtype = logits.dtype
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (n, V/tp)
        if held < logits.shape[-1]:  # padded columns: outside the vocabulary
            logits = logits.clone()
            logits[:, held:] = float("-inf")
        peak = logits.max(dim=-1).values  # (n,)
        comm.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - peak.unsqueeze(-1)  # (n, V/tp)
        exp = shifted.exp()
        total = exp.sum(dim=-1)  # (n,)
        comm.all_reduce(total, group=group)
        ignored = target == ignore_index
        mine = (target >= start) & (target < start + held) & ~ignored  # (n,)
        index = torch.where(mine, target - start, torch.zeros_like(target))
        gathered = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        picked = torch.where(mine, gathered, torch.zeros_like(gathered))  # (n,)
        comm.all_reduce(picked, group=group)
        count = (~ignored).sum().clamp(min=1)
        per_row = torch.where(ignored, torch.zeros_like(picked), total.log() - picked)
        loss = per_row.sum() / count
        ctx.save_for_backward(exp / total.unsqueeze(-1), index, mine, ignored, count)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        softmax, index, mine, ignored, count = ctx.saved_tensors
        g = softmax.clone()  # (n, V/tp)
        g.scatter_add_(-1, index.unsqueeze(-1), -mine.unsqueeze(-1).to(g.dtype))
        g = g * (~ignored).unsqueeze(-1) * (grad / count)
        return g.to(ctx.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int,
                                 held: int, comm: Collectives, group,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``target`` (n,) under logits split over tp (n, V/tp), this rank
    holding vocabulary rows [start, start + held)."""
    return _VocabParallelCrossEntropy.apply(logits, target, start, held, comm, group,
                                            ignore_index)


@contextlib.contextmanager
def local_logits(head: nn.Module) -> Iterator[None]:
    """Within the block, a vocabulary-parallel LM head returns this rank's logits (its slice
    of the vocabulary, padded) instead of gathering all of them."""
    previous, head.gather_output = head.gather_output, False
    try:
        yield
    finally:
        head.gather_output = previous


def causal_lm_loss_vocab_parallel(model: nn.Module, head: nn.Module, input_ids: torch.Tensor,
                                  labels: torch.Tensor, **inputs: Any) -> torch.Tensor:
    """Next-token loss of a causal LM whose head is vocabulary-parallel, from local logits:
    labels shifted by one position, ``-100`` ignored, as transformers computes it."""
    with local_logits(head):
        output = model(input_ids=input_ids, **inputs)
    logits = output.logits if hasattr(output, "logits") else output  # (b, s, V/tp)
    shifted = logits[:, :-1].reshape(-1, logits.shape[-1])  # (b*(s-1), V/tp)
    target = labels[:, 1:].reshape(-1)  # (b*(s-1),)
    return vocab_parallel_cross_entropy(shifted, target, head.vocab_start, head.vocab_held,
                                        head.comm, head.group)

"""Cross-entropy on the grid LM head's logits, without gathering the vocabulary.

``LMHead2D`` leaves rank (k, i, j) the logits of vocabulary chunk j for row block (k, i):
(b/(d*q), s, ceil(V/q)). Along the row that is exactly 1D's vocabulary-parallel layout, so
1D's loss (``parallel/tensor/cross_entropy.py``: the max, the sum of exponentials and the
target's logit, each one all-reduce of a number per token) runs unchanged over tp_row and gives
the mean over this row block's tokens, replicated along the row.

The loss is the mean over every token of the batch, so the row blocks are combined by their
counts of targets that are not ``ignore_index``: loss = sum over blocks of mean_b * n_b / N,
N = sum of n_b (an all-reduce of one integer over tp_col and tp_dep, outside autograd). The sum
over blocks is Megatron's g (all-reduce forward, identity backward) over tp_col then tp_dep:
every rank ends with the same loss, and backward from it gives each rank the gradient of its
own logits, as in 1D tensor parallelism where every rank calls backward on the same loss.
"""

from __future__ import annotations

import torch

from kernels_runtime.comm.autograd import reduce_from_group
from kernels_runtime.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from kernels_runtime.parallel.tensor.grid.grid import Grid
from kernels_runtime.parallel.tensor.grid.grid_comms import sum_replicas
from kernels_runtime.parallel.tensor.grid.sharding import grid_vocab_range


def grid_cross_entropy(logits: torch.Tensor, target: torch.Tensor, grid: Grid, vocab: int,
                       ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy over the whole batch. ``logits``: (b/(d*q), s, ceil(V/q)) or
    (n, ceil(V/q)) of vocabulary chunk j; ``target``: this row block's (b/(d*q), s) or (n,)."""
    start, held, _ = grid_vocab_range(vocab, grid)
    flat = logits.reshape(-1, logits.shape[-1])  # (n, V/q padded)
    labels = target.reshape(-1)  # (n,)
    mean = vocab_parallel_cross_entropy(flat, labels, start, held, grid.comm, grid.row,
                                        ignore_index)  # over this row block's targets
    count = (labels != ignore_index).sum()  # a tensor: no host sync
    total = sum_replicas(count.clone(), grid).clamp(min=1)  # N over the grid
    share = mean * count.to(mean.dtype) / total.to(mean.dtype)  # this block's sum / N
    share = reduce_from_group(share, grid.comm, grid.col)
    return reduce_from_group(share, grid.comm, grid.dep) if grid.dep is not None else share

"""Between a model's full tensors and the grid's activation blocks (its input and output).

Hidden states (b, s, h) live on rank (k, i, j) as block (b/(d*q), s, h/q): batch chunk
k*q + i of d*q, hidden chunk j of q. Token ids and labels (b, s) live as (b/(d*q), s) on the
row block (k, i), the same on every column. ``scatter_hidden`` / ``gather_hidden`` cross between
the two with the differentiable collectives of ``comm.autograd``, one grid axis at a time:
depth and column split (or gather) the batch, the row the hidden size. Entering, the full
tensor is replicated, so backward all-gathers the blocks' gradients; leaving, what follows is
replicated, so backward keeps this rank's block of the gradient (``backward="split"``).
"""

from __future__ import annotations

import torch

from kernels_runtime.comm.autograd import gather_from_group, scatter_to_group
from kernels_runtime.parallel.tensor.grid.grid import Grid

BATCH_DIM = 0


def _check_batch(batch: int, grid: Grid) -> None:
    if batch % grid.batch_chunks:
        raise ValueError(f"batch of {batch} does not split into the grid's {grid.batch_chunks} "
                         f"row blocks (d*q = {grid.depth}*{grid.side}); give each data-"
                         f"parallel rank a batch that is a multiple of {grid.batch_chunks}")


def scatter_hidden(x_full: torch.Tensor, grid: Grid) -> torch.Tensor:
    """(b, s, h), replicated -> this rank's block (b/(d*q), s, h/q)."""
    _check_batch(x_full.shape[BATCH_DIM], grid)
    x = x_full
    if grid.dep is not None:
        x = scatter_to_group(x, grid.comm, grid.dep, BATCH_DIM)  # (b/d, s, h)
    x = scatter_to_group(x, grid.comm, grid.col, BATCH_DIM)  # (b/(d*q), s, h)
    return scatter_to_group(x, grid.comm, grid.row, x.dim() - 1)  # (b/(d*q), s, h/q)


def gather_hidden(x_block: torch.Tensor, grid: Grid, width: int | None = None) -> torch.Tensor:
    """This rank's block (b/(d*q), s, h/q) -> (b, s, h), on every rank; ``width`` keeps the
    first ``width`` features (a padded vocabulary's true size, for logits)."""
    x = gather_from_group(x_block, grid.comm, grid.row, x_block.dim() - 1)  # (b/(d*q), s, h)
    x = gather_from_group(x, grid.comm, grid.col, BATCH_DIM)  # (b/d, s, h)
    if grid.dep is not None:
        x = gather_from_group(x, grid.comm, grid.dep, BATCH_DIM)  # (b, s, h)
    return x if width is None else x.narrow(-1, 0, width)


def scatter_ids(ids: torch.Tensor, grid: Grid) -> torch.Tensor:
    """(b, s) token ids or labels, the same on every rank -> row block (k, i)'s
    (b/(d*q), s). No communication, nothing to differentiate."""
    _check_batch(ids.shape[BATCH_DIM], grid)
    rows = ids.shape[BATCH_DIM] // grid.batch_chunks
    return ids.narrow(BATCH_DIM, grid.batch_chunk * rows, rows)

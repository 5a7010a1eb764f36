"""The collectives of the grid kernels: SUMMA's broadcasts and reduces, and the small sums.

SUMMA (van de Geijn and Watts 1997; Optimus, Xu et al. 2021) computes ``Y = X W`` on a
``q x q`` grid in q steps: at step l the activation block X[k,i,l] is broadcast along its row
and the weight block W[l,j] along its column, and every rank adds their product to its Y[k,i,j].
``summa_steps`` yields those pairs with step l+1's broadcasts already in flight while the
caller multiplies step l's (double buffering: two blocks of each kind alive at once).

SUMMA's backward needs reduces: dX[k,i,l] = sum_j dY[k,i,j] W[l,j]^T lands on column l of the
row, dW[l,j] = sum_i X[k,i,l]^T dY[k,i,j] on row l of the column. ``Collectives`` has no reduce,
and the q reduces of one backward (roots 0..q-1, one block each) are exactly one reduce-scatter
of the q stacked partial blocks: the same blocks, the same bytes, one call. The price is holding
the q partials at once, (q, ...) of one block.

Every call goes through the instrumented ``Collectives``, so the telemetry counts the bytes per
grid axis ("tp_row", "tp_col", "tp_dep"). A group of one rank (q = 1, or d = 1) is skipped.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from kernels_runtime.comm.collectives import PendingOp
from kernels_runtime.comm.groups import Group
from kernels_runtime.parallel.tensor.grid.grid import Grid


def _start_step(x: Tensor, w: Tensor, grid: Grid, step: int) -> tuple[Tensor, Tensor,
                                                                      list[PendingOp]]:
    """Issue step ``step``'s two broadcasts; this rank's own block is sent as it is."""
    xb = x if grid.j == step else torch.empty_like(x)  # X[k,i,step], (.., in/q)
    wb = w if grid.i == step else torch.empty_like(w)  # W[step,j]
    ops = [grid.comm.broadcast_async(xb, grid.row_ranks[step], group=grid.row),
           grid.comm.broadcast_async(wb, grid.col_ranks[step], group=grid.col)]
    return xb, wb, ops


def summa_steps(x: Tensor, w: Tensor, grid: Grid) -> Iterator[tuple[Tensor, Tensor]]:
    """(X[k,i,l], W[l,j]) for l = 0..q-1: ``x`` is this rank's X[k,i,j], ``w`` its W[i,j]
    (both contiguous)."""
    if grid.side == 1:
        yield x, w
        return
    pending = _start_step(x, w, grid, 0)
    for step in range(grid.side):
        xb, wb, ops = pending
        if step + 1 < grid.side:
            pending = _start_step(x, w, grid, step + 1)  # in flight during this step's matmul
        for op in ops:
            op.wait()
        yield xb, wb


def _reduce_scatter(parts: Tensor, grid: Grid, group: Group) -> Tensor:
    """(q, ...) partial blocks, part l for the group's rank l -> (...) this rank's sum."""
    if grid.side == 1:
        return parts[0]
    out = parts.new_empty(parts.shape[1:])  # (n, ...)
    flat = parts.contiguous().view(-1, *parts.shape[2:])  # (q*n, ...): the op's dim-0 layout
    grid.comm.reduce_scatter(out, flat, group=group)
    return out


def reduce_row(parts: Tensor, grid: Grid) -> Tensor:
    """SUMMA's reduce along the row: part l goes to column l, summed over the row."""
    return _reduce_scatter(parts, grid, grid.row)


def reduce_col(parts: Tensor, grid: Grid) -> Tensor:
    """SUMMA's reduce along the column: part l goes to row l, summed over the column."""
    return _reduce_scatter(parts, grid, grid.col)


def sum_row(t: Tensor, grid: Grid) -> Tensor:
    """Sum over the row (a norm's statistics over the whole hidden size); a new tensor."""
    out = t.contiguous().clone()
    return grid.comm.all_reduce(out, group=grid.row) if grid.side > 1 else out


def sum_depth(t: Tensor, grid: Grid) -> Tensor:
    """Sum over the depth replicas of a weight block (2.5D), in place; 2D: unchanged."""
    if grid.dep is not None:
        grid.comm.all_reduce(t, group=grid.dep)
    return t


def sum_replicas(t: Tensor, grid: Grid, depth: bool = True) -> Tensor:
    """Sum a column-replicated parameter's gradient (a bias or norm chunk j, held by every
    row and depth) over the column and, unless ``depth`` is off, the depth; in place."""
    t = t.contiguous()
    if grid.side > 1:
        grid.comm.all_reduce(t, group=grid.col)
    return sum_depth(t, grid) if depth else t


def gather_col(t: Tensor, grid: Grid) -> Tensor:
    """(...) on every row of the column -> (q, ...), part l from row l."""
    out = t.new_empty((grid.side, *t.shape))
    if grid.side == 1:
        return t.unsqueeze(0)
    grid.comm.all_gather(out.view(grid.side * t.shape[0], *t.shape[1:]), t.contiguous(),
                         group=grid.col)
    return out


def gather_row(t: Tensor, grid: Grid) -> Tensor:
    """(...) on every column of the row -> (q, ...), part l from column l."""
    out = t.new_empty((grid.side, *t.shape))
    if grid.side == 1:
        return t.unsqueeze(0)
    grid.comm.all_gather(out.view(grid.side * t.shape[0], *t.shape[1:]), t.contiguous(),
                         group=grid.row)
    return out


def swap_mirror(t: Tensor, grid: Grid) -> Tensor:
    """Exchange ``t`` with the rank at the transposed place (k, j, i); the diagonal keeps it."""
    if grid.i == grid.j:
        return t
    sent, received = t.contiguous(), torch.empty_like(t)
    ops = grid.comm.batch_p2p([("send", sent, grid.mirror), ("recv", received, grid.mirror)],
                              group=grid.tp)
    for op in ops:
        op.wait()
    return received

"""``Linear2D``: y = x W + b on the q x q grid by SUMMA (Optimus 2D; Tesseract 2.5D).

Rank (k, i, j) holds activation block X[k,i,j] (batch chunk k*q + i of d*q, input-feature chunk
j: (b/(d*q), s, in/q)) and weight block W[i,j] (in/q, out/q), the same on every depth. Forward
runs q steps; at step l, X[k,i,l] is broadcast along the row and W[l,j] along the column, and
Y[k,i,j] += X[k,i,l] W[l,j] (``grid_comms.summa_steps``). Backward re-broadcasts the same blocks
(only the rank's own X and W blocks are saved, so activation and weight memory stay 1/(d*q^2)
and 1/q^2) and uses SUMMA's reduce variants:

    dX[k,i,l] = sum_j dY[k,i,j] W[l,j]^T    partial on (k,i,j), reduced along the row to l
    dW[l,j]   = sum_i X[k,i,l]^T dY[k,i,j]  partial on (k,i,j), reduced along the column to l,
                                            then summed over the depths (2.5D)

The bias (out/q, chunk j, replicated down the column and over depths) is added once, after the
last step; its gradient is summed over the column and the depths. The weight may be stored as
``nn.Linear``'s (out, in) block (out/q, in/q), or ``Conv1D``'s (in, out) block with
``transposed``. A fused output (GPT-2's c_attn = [q|k|v]) needs nothing here: ``sharding.py``
puts chunk j of every part side by side in column j, so the output block is [q_j | k_j | v_j].

Bytes per rank, as ``Collectives`` counts them (payload handed to each op, element size e),
for one forward + backward with n = b*s/(d*q) tokens per rank, m inputs and o outputs:

    tp_row broadcast       2 * q * (n*m/q) e     = 2 n m e       (X blocks, fwd + bwd)
    tp_col broadcast       2 * q * (m*o/q^2) e   = 2 m o e / q   (W blocks, fwd + bwd)
    tp_row reduce_scatter  q * (n*m/q) e         = n m e         (dX)
    tp_col reduce_scatter  q * (m*o/q^2) e       = m o e / q     (dW)
    tp_dep all_reduce      (m*o/q^2 + o/q) e     only if d > 1   (dW, db over depths)
    tp_col all_reduce      (o/q) e               with a bias     (db)

Total 3 n m e + 3 m o e / q (+ m o e / q^2 when d > 1, + the bias terms). A ring or tree
broadcast puts about the payload on the wire once per rank, so this is also (q-1)/q of the
traffic up to rounding; see ColossalAI's table in REFERENCES.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernels_runtime.mesh.shards import ParamLayout
from kernels_runtime.parallel.tensor.grid.grid import Grid
from kernels_runtime.parallel.tensor.grid.grid_comms import (
    reduce_col,
    reduce_row,
    sum_depth,
    sum_replicas,
    summa_steps,
)
from kernels_runtime.parallel.tensor.grid.sharding import split_features, split_weight


def _times_w(x: torch.Tensor, w: torch.Tensor, transposed: bool) -> torch.Tensor:
    return x @ w if transposed else x @ w.t()  # (n, in/q) -> (n, out/q)


class _Summa(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                grid: Grid, transposed: bool, reduce_depth: bool) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1]).contiguous()  # (n, in/q), n = b/(d*q) * s
        w = weight.contiguous()
        acc: torch.Tensor | None = None  # fp32 accumulator of Y[k,i,j]
        for x_l, w_l in summa_steps(flat, w, grid):
            part = _times_w(x_l, w_l, transposed)  # (n, out/q): X[k,i,l] W[l,j]
            acc = part.float() if acc is None else acc.add_(part)
        if bias is not None:
            acc = acc.add_(bias)  # once, not once per step
        ctx.save_for_backward(flat, weight)
        ctx.grid, ctx.transposed, ctx.reduce_depth = grid, transposed, reduce_depth
        ctx.lead, ctx.has_bias = lead, bias is not None
        return acc.to(x.dtype).view(*lead, acc.shape[-1])  # (.., out/q)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        flat, weight = ctx.saved_tensors
        grid, transposed, q = ctx.grid, ctx.transposed, ctx.grid.side
        # a frozen weight (LoRA's base) gets no dW: every rank of the grid skips the same
        # products and reduces, as requires_grad is the same everywhere
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g = grad.reshape(-1, grad.shape[-1]).contiguous()  # (n, out/q): dY[k,i,j]
        dx_parts = g.new_empty((q, *flat.shape)) if need_x else None  # part l: X[k,i,l]'s
        dw_parts = weight.new_empty((q, *weight.shape)) if need_w else None  # W[l,j]'s
        for step, (x_l, w_l) in enumerate(summa_steps(flat, weight.contiguous(), grid)):
            if need_x:
                torch.mm(g, w_l.t() if transposed else w_l, out=dx_parts[step])  # (n, in/q)
            if need_w and transposed:
                torch.mm(x_l.t(), g, out=dw_parts[step])  # (in/q, out/q)
            elif need_w:
                torch.mm(g.t(), x_l, out=dw_parts[step])  # (out/q, in/q)
        dx = reduce_row(dx_parts, grid).view(*ctx.lead, flat.shape[-1]) if need_x else None
        dw = reduce_col(dw_parts, grid) if need_w else None  # (.., in/q) and W's block
        if need_w and ctx.reduce_depth:
            dw = sum_depth(dw, grid)
        db = None
        if ctx.has_bias and need_b:
            db = sum_replicas(g.float().sum(0).to(g.dtype), grid, ctx.reduce_depth)  # (out/q,)
        return dx, dw, db, None, None, None


class Linear2D(nn.Module):
    """y = x W + b with x, y and W in grid blocks (module docstring): (b/(d*q), s, in/q) in,
    (b/(d*q), s, out/q) out.

    ``weight`` is W[i, j]: (out/q, in/q), or (in/q, out/q) with ``transposed``; an existing
    ``nn.Parameter`` is kept as it is (a tied LM head shares the embedding's). ``bias`` is chunk
    j, (out/q,). With ``reduce_depth`` off, the weight and bias gradients are left unsummed over
    the 2.5D depths, for a data-parallel reducer to sum with its own (as it would over dp)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, grid: Grid,
                 transposed: bool = False, reduce_depth: bool = True) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.bias = None if bias is None else (
            bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias))
        self.grid, self.transposed, self.reduce_depth = grid, transposed, reduce_depth
        self.layouts: dict[str, ParamLayout] = {}

    @classmethod
    def from_full(cls, weight: torch.Tensor, bias: torch.Tensor | None, grid: Grid,
                  transposed: bool = False, parts: int = 1,
                  reduce_depth: bool = True) -> Linear2D:
        """Cut whole parameters (``parts`` fused outputs) into this rank's blocks; their
        layouts are in ``.layouts``."""
        w, w_layout = split_weight(weight.detach(), grid, transposed, parts)
        layer = cls(w, None, grid, transposed, reduce_depth)
        layer.layouts["weight"] = w_layout
        if bias is not None:
            b, layer.layouts["bias"] = split_features(bias.detach(), grid, parts)
            layer.bias = nn.Parameter(b)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Summa.apply(x, self.weight, self.bias, self.grid, self.transposed,
                            self.reduce_depth)

    def extra_repr(self) -> str:
        return (f"block={tuple(self.weight.shape)}, transposed={self.transposed}, "
                f"bias={self.bias is not None}, {self.grid.describe()}")

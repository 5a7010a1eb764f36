"""``LayerNorm2D`` and ``RMSNorm2D``: norms over a hidden size split along the grid's row.

Rank (k, i, j) holds hidden chunk j of its batch block, (b/(d*q), s, h/q), so a token's
statistics are sums over the row: each rank sums its chunk and one all-reduce along tp_row
completes them. LayerNorm takes two (the mean, then the centred sum of squares: the two-pass
variance torch computes, not E[x^2] - E[x]^2, which cancels badly when |mean| >> std); RMSNorm
one. The math is in fp32 whatever the input dtype, as torch.nn.LayerNorm does inside and
transformers' LlamaRMSNorm does explicitly (including its cast back to the input dtype before
the weight), so both match the unsplit modules.

Backward is written out rather than differentiated through the all-reduces (whose gradient
would need one more all-reduce per statistic): with xhat the normalized input and g = dy * w,

    LayerNorm  dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    RMSNorm    dx = rstd * (g - xhat * mean(g * xhat))

where the means are over the whole hidden size: one all-reduce along the row of the stacked
row sums. The weight (and bias) is chunk j, replicated down the column and over the depths, so
its gradient is summed over tp_col and tp_dep (one all-reduce each, weight and bias packed).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernels_runtime.parallel.tensor.grid.grid import Grid
from kernels_runtime.parallel.tensor.grid.grid_comms import sum_replicas, sum_row


def _leading_sum(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).sum(0)  # (.., h/q) -> (h/q,)


class _LayerNorm2D(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                grid: Grid, eps: float, reduce_depth: bool) -> torch.Tensor:
        hidden = x.shape[-1] * grid.side
        xf = x.float()  # (b/(d*q), s, h/q)
        mean = sum_row(xf.sum(-1, keepdim=True), grid) / hidden  # (b/(d*q), s, 1)
        centred = xf - mean
        var = sum_row(centred.square().sum(-1, keepdim=True), grid) / hidden
        rstd = torch.rsqrt(var + eps)
        y = centred * rstd * weight.float()
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(x, mean, rstd, weight)
        ctx.grid, ctx.reduce_depth, ctx.has_bias = grid, reduce_depth, bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, mean, rstd, weight = ctx.saved_tensors
        grid, hidden = ctx.grid, x.shape[-1] * ctx.grid.side
        xhat = (x.float() - mean) * rstd
        gy = grad.float()
        g = gy * weight.float()
        sums = torch.cat([g.sum(-1, keepdim=True), (g * xhat).sum(-1, keepdim=True)], -1)
        means = sum_row(sums, grid) / hidden  # (b/(d*q), s, 2)
        dx = rstd * (g - means[..., :1] - xhat * means[..., 1:])
        packed = [_leading_sum(gy * xhat)] + ([_leading_sum(gy)] if ctx.has_bias else [])
        reduced = sum_replicas(torch.cat(packed), grid, ctx.reduce_depth)  # (h/q,) or (2h/q,)
        dw, db = reduced[:weight.shape[0]], reduced[weight.shape[0]:] if ctx.has_bias else None
        return (dx.to(x.dtype), dw.to(weight.dtype), None if db is None else db.to(weight.dtype),
                None, None, None)


class _RMSNorm2D(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, grid: Grid, eps: float,
                reduce_depth: bool) -> torch.Tensor:
        hidden = x.shape[-1] * grid.side
        xf = x.float()  # (b/(d*q), s, h/q)
        square = sum_row(xf.square().sum(-1, keepdim=True), grid) / hidden  # (b/(d*q), s, 1)
        rstd = torch.rsqrt(square + eps)
        ctx.save_for_backward(x, rstd, weight)
        ctx.grid, ctx.reduce_depth = grid, reduce_depth
        return weight * (xf * rstd).to(x.dtype)  # LlamaRMSNorm: cast, then the weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, rstd, weight = ctx.saved_tensors
        grid, hidden = ctx.grid, x.shape[-1] * ctx.grid.side
        xhat = x.float() * rstd
        dw = _leading_sum((grad * xhat.to(x.dtype)).float())  # (h/q,)
        dw = sum_replicas(dw, grid, ctx.reduce_depth)
        g = (grad * weight).float()  # the cast to x.dtype passes the gradient through
        dot = sum_row((g * xhat).sum(-1, keepdim=True), grid) / hidden  # (b/(d*q), s, 1)
        dx = rstd * (g - xhat * dot)
        return dx.to(x.dtype), dw.to(weight.dtype), None, None, None


class LayerNorm2D(nn.Module):
    """torch.nn.LayerNorm over the last dim, hidden chunk j of it on this rank: weight and bias
    are chunk j, (h/q,). ``reduce_depth`` as for ``Linear2D``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, grid: Grid,
                 eps: float = 1e-5, reduce_depth: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # (h/q,)
        self.bias = nn.Parameter(bias) if bias is not None else None  # (h/q,)
        self.grid, self.eps, self.reduce_depth = grid, eps, reduce_depth
        self.normalized_shape = (weight.shape[0] * grid.side,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LayerNorm2D.apply(x, self.weight, self.bias, self.grid, self.eps,
                                  self.reduce_depth)


class RMSNorm2D(nn.Module):
    """transformers' LlamaRMSNorm over the last dim, hidden chunk j of it on this rank."""

    def __init__(self, weight: torch.Tensor, grid: Grid, eps: float = 1e-6,
                 reduce_depth: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # (h/q,)
        self.grid, self.variance_epsilon, self.reduce_depth = grid, eps, reduce_depth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm2D.apply(x, self.weight, self.grid, self.variance_epsilon,
                                self.reduce_depth)

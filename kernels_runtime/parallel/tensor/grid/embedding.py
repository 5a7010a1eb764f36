"""``Embedding2D`` and ``LMHead2D``: the vocabulary on the grid, one local tensor for both.

Placement. Rank (k, i, j) holds E[V_j, H_i]: vocabulary chunk j (ceil(V/q) rows, zero-padded)
and hidden chunk i. That is exactly block (i, j) of the LM head's weight E^T (in h, out V) in
``nn.Linear`` storage, (V/q, h/q), so a tied head is a ``Linear2D`` on the embedding's own
``nn.Parameter`` (``LMHead2D.tied``): the two gradients accumulate into one tensor, each already
summed over the grid, and no copy or extra all-reduce ties them.

Lookup. The output block Y[k,r,v] (row r's tokens, hidden chunk v) needs sum over vocabulary
chunks u of E[ids in V_u, H_v], held along row v (ranks (k, v, u)): a transposed placement.
So rank (k, r, v), holding E[V_v, H_r], looks up the tokens of every row l of its depth (ids
all-gathered along the column: q * b/(d*q) * s integers) in its block, the partial of
Y[k,l,r] from chunk v; a reduce-scatter along the row sums them over u and leaves Y[k,v,r] on
(k, r, v); one p2p swap with the mirror rank (k, v, r) puts each block in place (the diagonal
keeps its own). Backward runs it in reverse: swap dY, all-gather it along the row (dY[k,l,r] for
every l), scatter-add into this block for every row's tokens, sum over depths. No weight block
ever moves, unlike a SUMMA product with the one-hot ids (q broadcasts of V*h/q^2 each).

Bytes per rank (n = b*s/(d*q) tokens per rank, e the element size): forward 8*n (ids) +
n*h*e (reduce-scatter) + 2*n*h*e/q (swap, off the diagonal); backward 2*n*h*e/q + n*h*e/q
(all-gather) + V*h*e/q^2 over tp_dep when d > 1.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernels_runtime.mesh.shards import ParamLayout
from kernels_runtime.parallel.tensor.grid.grid import Grid
from kernels_runtime.parallel.tensor.grid.grid_comms import (
    gather_col,
    gather_row,
    reduce_row,
    sum_depth,
    swap_mirror,
)
from kernels_runtime.parallel.tensor.grid.linear import Linear2D
from kernels_runtime.parallel.tensor.grid.sharding import (
    chunk_replica,
    grid_vocab_range,
    split_vocab,
)


class _Embedding2D(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, grid: Grid, start: int,
                held: int, padding_idx: int | None, reduce_depth: bool) -> torch.Tensor:
        every = gather_col(ids, grid)  # (q, b/(d*q), s): the tokens of row l of this depth
        inside = (every >= start) & (every < start + held)
        local = torch.where(inside, every - start, torch.zeros_like(every))
        parts = nn.functional.embedding(local, weight)  # (q, b/(d*q), s, h/q)
        parts = parts.masked_fill(~inside.unsqueeze(-1), 0.0)  # part l: Y[k,l,i] from V_j
        mine = reduce_row(parts, grid)  # Y[k,j,i] summed over vocabulary chunks
        ctx.save_for_backward(local, inside)
        ctx.grid, ctx.shape, ctx.padding_idx = grid, weight.shape, padding_idx
        ctx.start, ctx.held, ctx.reduce_depth = start, held, reduce_depth
        return swap_mirror(mine, grid)  # Y[k,i,j]: (b/(d*q), s, h/q)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        local, inside = ctx.saved_tensors
        grid, (rows, width) = ctx.grid, ctx.shape
        every = gather_row(swap_mirror(grad, grid), grid)  # (q, b/(d*q), s, h/q): dY[k,l,i]
        every = (every * inside.unsqueeze(-1)).float().reshape(-1, width)
        dw = every.new_zeros((rows, width)).index_add_(0, local.reshape(-1), every)
        index = None if ctx.padding_idx is None else ctx.padding_idx - ctx.start
        if index is not None and 0 <= index < ctx.held:
            dw[index] = 0.0  # nn.Embedding's padding_idx: that row never learns
        if ctx.reduce_depth:
            dw = sum_depth(dw, grid)
        return None, dw.to(grad.dtype), None, None, None, None, None


class Embedding2D(nn.Module):
    """nn.Embedding on the grid: ids (b/(d*q), s) of row block (k, i) -> (b/(d*q), s, h/q);
    ``weight`` is E[V_j, H_i], (ceil(V/q), h/q) (module docstring), ``vocab`` the true V."""

    def __init__(self, weight: torch.Tensor, grid: Grid, vocab: int,
                 padding_idx: int | None = None, reduce_depth: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.grid, self.vocab_size, self.padding_idx = grid, vocab, padding_idx
        self.vocab_start, self.vocab_held, _ = grid_vocab_range(vocab, grid)
        self.reduce_depth = reduce_depth
        self.layouts: dict[str, ParamLayout] = {}

    @classmethod
    def from_full(cls, weight: torch.Tensor, grid: Grid, padding_idx: int | None = None,
                  reduce_depth: bool = True) -> Embedding2D:
        """Cut a whole (V, h) embedding into this rank's block; its layout is in ``.layouts``."""
        local, layout = split_vocab(weight.detach(), grid)
        module = cls(local, grid, weight.shape[0], padding_idx, reduce_depth)
        module.layouts["weight"] = layout
        return module

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _Embedding2D.apply(ids, self.weight, self.grid, self.vocab_start,
                                  self.vocab_held, self.padding_idx, self.reduce_depth)


class LMHead2D(Linear2D):
    """Logits of vocabulary chunk j for row block (k, i): (b/(d*q), s, h/q) ->
    (b/(d*q), s, ceil(V/q)); columns past ``vocab_held`` are padding (``grid_cross_entropy``
    ignores them; ``gather_hidden(.., width=vocab)`` drops them)."""

    def __init__(self, weight: torch.Tensor, grid: Grid, vocab: int,
                 bias: torch.Tensor | None = None, reduce_depth: bool = True) -> None:
        super().__init__(weight, bias, grid, transposed=False, reduce_depth=reduce_depth)
        self.vocab_size = vocab
        self.vocab_start, self.vocab_held, _ = grid_vocab_range(vocab, grid)

    @classmethod
    def tied(cls, embedding: Embedding2D, bias: torch.Tensor | None = None) -> LMHead2D:
        """A head on the embedding's own parameter (placement: module docstring), with a
        whole (V,) ``bias`` of its own when the model has one (BERT's decoder)."""
        head = cls(embedding.weight, embedding.grid, embedding.vocab_size,
                   reduce_depth=embedding.reduce_depth)
        head.layouts = dict(embedding.layouts)
        head._own_bias(bias)
        return head

    @classmethod
    def untied(cls, weight: torch.Tensor, grid: Grid, bias: torch.Tensor | None = None,
               reduce_depth: bool = True) -> LMHead2D:
        """A head of its own from a whole (V, h) weight (and (V,) bias), cut like the
        embedding."""
        local, layout = split_vocab(weight.detach(), grid)
        head = cls(local, grid, weight.shape[0], None, reduce_depth)
        head.layouts["weight"] = layout
        head._own_bias(bias)
        return head

    def _own_bias(self, bias: torch.Tensor | None) -> None:
        """Chunk j of a whole (V,) bias, padded like the vocabulary, laid out as the weight."""
        if bias is None:
            return
        grid, vocab = self.grid, self.vocab_size
        start, held, per = grid_vocab_range(vocab, grid)
        local = bias.detach().new_zeros(per)
        local[:held] = bias.detach()[start:start + held]
        self.bias = nn.Parameter(local)
        blocks = (((0,), (start,), (held,)),) if held else ()
        self.layouts["bias"] = ParamLayout((vocab,), blocks, self.layouts["weight"].sharded,
                                           chunk_replica(grid))

"""Cutting whole parameters into this rank's grid block, with its ``ParamLayout``.

On the ``q x q`` grid (the same on every depth) rank (k, i, j) holds weight block W[i, j]:
input-feature chunk i, output-feature chunk j, in the model's own storage (``nn.Linear``'s
(out, in): rows chunk j, columns chunk i; transformers' ``Conv1D``, GPT-2's, (in, out): rows
chunk i, columns chunk j). A fused output (GPT-2's ``c_attn`` = [q | k | v]) is cut part by part,
so column j holds chunk j of every part side by side (its heads of q, of k, of v) and the local
tensor is several boxes of the global one. Biases and norm weights are indexed by output or
hidden features: chunk j (of each part), replicated down the column and over depths.

The vocabulary of an embedding (V, h) is cut as the tied LM head needs it: rank (k, i, j) holds
E[vocabulary chunk j, hidden chunk i], which is block (i, j) of the head's weight E^T in
``nn.Linear`` storage, so head and embedding share one local tensor. V is padded up to a
multiple of q with zero rows (1D's ``vocab_range``); the layout keeps the true V.
"""

from __future__ import annotations

import itertools

import torch

from kernels_runtime.mesh.shards import ParamLayout
from kernels_runtime.parallel.tensor.grid.grid import Grid
from kernels_runtime.parallel.tensor.sharding import vocab_range

TP = frozenset({"tp"})  # blocks differ along tp (and repeat over the d depths of 2.5D)
Cut = tuple[int, int, int]  # (chunk index, chunks, parts) along one dim


def weight_replica(grid: Grid) -> tuple[int, int]:
    """A weight block W[i, j] repeats on every depth: (k, d)."""
    return grid.k, grid.depth


def chunk_replica(grid: Grid) -> tuple[int, int]:
    """A chunk j (bias, norm weight) repeats down the column and on every depth."""
    return grid.k * grid.side + grid.i, grid.depth * grid.side


def _cut(full: torch.Tensor, cuts: dict[int, Cut],
         replica: tuple[int, int]) -> tuple[torch.Tensor, ParamLayout]:
    """Along each dim in ``cuts``, chunk ``index`` of ``chunks`` taken from each of ``parts``
    equal parts, side by side; other dims whole. ``replica``: the layout's copies (see
    ``ParamLayout.replica``)."""
    per_dim = []  # per dim: [(local offset, global offset, size)] one per part
    for dim, width in enumerate(full.shape):
        index, chunks, parts = cuts.get(dim, (0, 1, 1))
        if width % (parts * chunks):
            raise ValueError(f"dim {dim} of size {width} does not split into {parts} part(s) "
                             f"of {chunks} equal chunks")
        part, chunk = width // parts, width // (parts * chunks)
        per_dim.append([(p * chunk, p * part + index * chunk, chunk) for p in range(parts)])
    shape = tuple(sum(size for _, _, size in pieces) for pieces in per_dim)
    local = full.new_empty(shape)
    blocks = []
    for combo in itertools.product(*per_dim):
        at, where, sizes = (tuple(c[n] for c in combo) for n in range(3))
        local[tuple(slice(a, a + s) for a, s in zip(at, sizes))] = \
            full[tuple(slice(w, w + s) for w, s in zip(where, sizes))]
        blocks.append((at, where, sizes))
    return local, ParamLayout(tuple(full.shape), tuple(blocks), TP, replica)


def split_weight(full: torch.Tensor, grid: Grid, transposed: bool = False,
                 parts: int = 1) -> tuple[torch.Tensor, ParamLayout]:
    """W[i, j] of a whole (out, in) weight, or (in, out) when ``transposed`` (``Conv1D``);
    ``parts`` equal fused parts along the output features."""
    q = grid.side
    out_dim, in_dim = (1, 0) if transposed else (0, 1)
    return _cut(full, {out_dim: (grid.j, q, parts), in_dim: (grid.i, q, 1)},
                weight_replica(grid))


def split_features(full: torch.Tensor, grid: Grid, parts: int = 1,
                   dim: int = 0) -> tuple[torch.Tensor, ParamLayout]:
    """Chunk j (of each of ``parts``) along ``dim`` of a (features,) bias or norm weight, or
    of a LoRA factor ((out, r) B by its output rows, (r, in) A by its input columns, dim 1):
    held by every row and depth alike."""
    return _cut(full, {dim: (grid.j, grid.side, parts)}, chunk_replica(grid))


def grid_vocab_range(vocab: int, grid: Grid) -> tuple[int, int, int]:
    """(first row, rows held, padded rows per column) of column j's vocabulary chunk."""
    return vocab_range(vocab, grid.j, grid.side)


def split_vocab(full: torch.Tensor, grid: Grid) -> tuple[torch.Tensor, ParamLayout]:
    """E[vocabulary chunk j, hidden chunk i] of a whole (V, h) embedding, zero-padded to
    ceil(V/q) rows: also the tied head's W[i, j] (module docstring)."""
    vocab, hidden = full.shape
    if hidden % grid.side:
        raise ValueError(f"hidden size {hidden} does not split into {grid.side} chunks")
    start, held, per = grid_vocab_range(vocab, grid)
    width = hidden // grid.side
    local = full.new_zeros((per, width))  # (ceil(V/q), h/q)
    local[:held] = full[start:start + held, grid.i * width:(grid.i + 1) * width]
    blocks = (((0, 0), (start, grid.i * width), (held, width)),) if held else ()
    return local, ParamLayout(tuple(full.shape), blocks, TP, weight_replica(grid))

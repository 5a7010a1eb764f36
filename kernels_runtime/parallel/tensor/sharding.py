"""Cutting a whole weight into this rank's tensor-parallel shard, with its ``ParamLayout``.

1D tensor parallelism (Megatron) splits a weight along one tensor dim: the output features of
a column-parallel layer, the input features of a row-parallel one, the vocabulary of an
embedding or LM head. Which dim that is depends on the storage: ``nn.Linear`` keeps
(out, in), transformers' ``Conv1D`` (GPT-2) keeps (in, out). A fused projection (GPT-2's
``c_attn`` = [q | k | v]) is split part by part, so each rank keeps its own heads of every part
and the local tensor is several boxes of the global one. A vocabulary that does not divide by
tp (GPT-2's 50257) is padded locally with zero rows; the padding is nobody's global state, so
the layout and every checkpoint keep the true, unpadded size.
"""

from __future__ import annotations

import math

import torch

from kernels_runtime.mesh.shards import ParamLayout

TP = frozenset({"tp"})


def split_dim(full: torch.Tensor, dim: int, rank: int, tp: int,
              parts: int = 1) -> tuple[torch.Tensor, ParamLayout]:
    """Chunk ``rank`` of ``tp`` along ``dim``, taken from each of ``parts`` equal parts of that
    dim (a fused projection), side by side; the layout maps each chunk to its global place."""
    width = full.shape[dim]
    if width % (parts * tp):
        raise ValueError(f"dim {dim} of size {width} does not split into {parts} part(s) of "
                         f"{tp} equal chunks")
    part, chunk = width // parts, width // (parts * tp)
    pieces, blocks = [], []
    for p in range(parts):
        start = p * part + rank * chunk
        pieces.append(full.narrow(dim, start, chunk))
        local = [0] * full.dim()
        local[dim] = p * chunk
        global_ = [0] * full.dim()
        global_[dim] = start
        sizes = list(full.shape)
        sizes[dim] = chunk
        blocks.append((tuple(local), tuple(global_), tuple(sizes)))
    local_tensor = torch.cat(pieces, dim=dim).contiguous()
    return local_tensor, ParamLayout(tuple(full.shape), tuple(blocks), TP)


def vocab_range(vocab: int, rank: int, tp: int) -> tuple[int, int, int]:
    """(first row, rows held, padded rows per rank) of a vocabulary split over tp, padded up
    to a multiple of tp."""
    per_rank = math.ceil(vocab / tp)
    start = min(vocab, rank * per_rank)
    return start, max(0, min(vocab, start + per_rank) - start), per_rank


def split_vocab(full: torch.Tensor, rank: int, tp: int) -> tuple[torch.Tensor, ParamLayout]:
    """This rank's rows of a (vocab, ...) tensor, zero-padded to the same count on every rank."""
    vocab = full.shape[0]
    start, held, per_rank = vocab_range(vocab, rank, tp)
    local = full.new_zeros((per_rank, *full.shape[1:]))
    local[:held] = full[start:start + held]
    zero = (0,) * full.dim()
    blocks = ((zero, (start, *zero[1:]), (held, *full.shape[1:])),) if held else ()
    return local, ParamLayout(tuple(full.shape), blocks, TP)

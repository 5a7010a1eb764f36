"""Which tokens each sequence-parallel rank holds, and how to cut and rebuild a sequence.

Under causal attention a query sees only earlier keys, so with the contiguous layout (rank r
holds the r-th sp-th of the sequence) the last rank does about 2*sp - 1 times the first rank's
work and the ring waits on it. The zig-zag layout (Megatron-Core's load-balanced context
parallelism; zhuzilin/ring-flash-attention's zigzag ring) cuts the sequence into 2*sp chunks
and gives rank r chunks r and 2*sp-1-r: an early and a late chunk, so every rank's queries
see about the same number of keys. Positions are global token indices, in the order the rank
stores them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def _check(seq: int, rank: int, sp: int, chunks: int, layout: str) -> None:
    if sp < 1 or not 0 <= rank < sp:
        raise ValueError(f"{layout} layout: rank {rank} is not in a group of sp={sp} ranks")
    if seq % chunks:
        below, above = seq // chunks * chunks, (seq // chunks + 1) * chunks
        works = f"{below} or {above}" if below else f"{above}"
        cut = f"2*sp={chunks}" if chunks != sp else f"sp={sp}"
        raise ValueError(
            f"sequence length {seq} does not split into the {cut} equal chunks of the {layout} "
            f"layout (sp={sp}); lengths that work are multiples of {chunks} (e.g. {works}): "
            "pad the batch to one")


def zigzag_positions(seq: int, rank: int, sp: int) -> Tensor:
    """Global positions held by `rank`: chunks rank and 2*sp-1-rank of 2*sp, concatenated."""
    _check(seq, rank, sp, 2 * sp, "zig-zag")
    chunk = seq // (2 * sp)
    late = 2 * sp - 1 - rank
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange(late * chunk, (late + 1) * chunk)])  # (seq/sp,)


def contiguous_positions(seq: int, rank: int, sp: int) -> Tensor:
    """Global positions held by `rank`: the rank-th of sp equal contiguous pieces."""
    _check(seq, rank, sp, sp, "contiguous")
    piece = seq // sp
    return torch.arange(rank * piece, (rank + 1) * piece)  # (seq/sp,)


def shard_sequence(x: Tensor, positions: Tensor, dim: int) -> Tensor:
    """This rank's tokens of a full-sequence tensor: ``x`` indexed by ``positions`` on ``dim``."""
    return x.index_select(dim, positions.to(x.device))


def unshard_sequence(pieces: Sequence[Tensor], positions: Sequence[Tensor], dim: int) -> Tensor:
    """The full sequence from every rank's piece (in rank order) and the positions it holds."""
    if len(pieces) != len(positions):
        raise ValueError(f"{len(pieces)} pieces but {len(positions)} position lists: give one "
                         "per rank, both in rank order")
    for i, (piece, pos) in enumerate(zip(pieces, positions)):
        if piece.shape[dim] != pos.numel():
            raise ValueError(f"rank {i}'s piece has {piece.shape[dim]} tokens along dim {dim} "
                             f"but {pos.numel()} positions")
    stacked = torch.cat(list(pieces), dim)  # (.., seq, ..) in rank order
    order = torch.cat([p.reshape(-1) for p in positions]).to(stacked.device)  # (seq,)
    if not torch.equal(order.sort().values, torch.arange(order.numel(), device=order.device)):
        raise ValueError("the positions do not cover 0..seq-1 exactly once")
    return stacked.index_select(dim, order.argsort())  # (.., seq, ..) in token order

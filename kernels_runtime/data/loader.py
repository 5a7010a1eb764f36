"""Deterministic data for data-parallel training: token windows by step, and index sharding.

Two properties make distributed runs testable and resumable:

* the global batch at a step depends only on ``(seed, step)``, never on how many ranks share it,
  so a single-process reference computes exactly what the ranks computed together;
* ``batch(step)`` needs no iterator state, so resuming from a checkpoint at step ``k`` is just
  ``batch(k)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

_MASK63 = (1 << 63) - 1


def _step_seed(seed: int, step: int) -> int:
    """Mix (seed, step) into one 63-bit generator seed (splitmix64 finaliser).

    Plain ``seed + step`` would make seed 0 step 1 equal seed 1 step 0.
    """
    x = (seed * 0x9E3779B97F4A7C15 + step + 1) & ((1 << 64) - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 31)) & _MASK63


Batch = tuple[torch.Tensor, torch.Tensor]


class TokenBatches:
    """Random fixed-length windows of a 1-D token tensor, one global batch per step.

    Every rank draws the same ``global_batch`` window starts from a generator seeded by
    ``(seed, step)`` and keeps rows ``[r*b, (r+1)*b)`` with ``b = global_batch // dp_size``.
    Labels follow transformers' convention: they are the input ids themselves, and the loss
    shifts them (an HF model given ``labels``, and both of ``train_step``'s objectives,
    ``causal_lm_loss`` and ``next_token_loss``, predict ``labels[:, t + 1]`` from position
    ``t``). Labels shifted here as well would train the model to predict two tokens ahead.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        seq_len: int,
        global_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        *,
        start_step: int = 0,
    ) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1 or global_batch < 1 or dp_size < 1:
            raise ValueError(
                f"seq_len, global_batch and dp_size must be >= 1, got "
                f"{seq_len=}, {global_batch=}, {dp_size=}"
            )
        if global_batch % dp_size:
            raise ValueError(f"global_batch={global_batch} is not divisible by dp_size={dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is out of range for dp_size={dp_size}")
        if tokens.numel() < seq_len + 1:
            raise ValueError(
                f"seq_len={seq_len} is too long for a corpus of {tokens.numel()} tokens "
                f"(each window needs seq_len + 1 tokens for its labels)"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.start_step = start_step
        self.local_batch = global_batch // dp_size
        self._offsets = torch.arange(seq_len + 1)

    def global_starts(self, step: int) -> torch.Tensor:
        """Start offsets of all ``global_batch`` windows at ``step``: (global_batch,)."""
        g = torch.Generator().manual_seed(_step_seed(self.seed, step))
        high = self.tokens.numel() - self.seq_len  # last valid start is numel - seq_len - 1
        return torch.randint(0, high, (self.global_batch,), generator=g)

    def batch(self, step: int) -> Batch:
        """This rank's ``(input_ids, labels)``, each int64 of shape (global_batch/dp, seq_len);
        the labels equal the inputs (the loss shifts them; class docstring)."""
        lo = self.dp_rank * self.local_batch
        starts = self.global_starts(step)[lo : lo + self.local_batch]  # (b,)
        windows = self.tokens[starts[:, None] + self._offsets].long()  # (b, s+1)
        inputs = windows[:, :-1].contiguous()  # (b, s)
        return inputs, inputs.clone()

    def microbatches(self, step: int, n: int) -> list[Batch]:
        """This rank's batch at ``step`` split into ``n`` equal micro-batches, in row order."""
        if n < 1 or self.local_batch % n:
            raise ValueError(
                f"per-rank batch {self.local_batch} cannot be split into {n} equal micro-batches"
            )
        inputs, labels = self.batch(step)
        return list(zip(inputs.chunk(n), labels.chunk(n)))

    def iter_from(self, step: int) -> Iterator[Batch]:
        """Batches for ``step, step + 1, ...`` without end."""
        while True:
            yield self.batch(step)
            step += 1

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_from(self.start_step)


def _check_shard(n: int, dp_rank: int, dp_size: int) -> None:
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is out of range for dp_size={dp_size}")


def _per_rank(n: int, dp_size: int, drop_last: bool) -> int:
    return n // dp_size if drop_last else -(-n // dp_size)


def shard_indices(
    n: int,
    dp_rank: int,
    dp_size: int,
    *,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
) -> list[int]:
    """This rank's indices into a dataset of ``n`` items, like ``DistributedSampler``.

    The (optionally shuffled) order is made evenly divisible by ``dp_size``, either by dropping
    the tail (``drop_last``) or by repeating indices from the front, then dealt out round-robin.
    Each rank gets ``floor(n / dp_size)`` indices with ``drop_last``, else ``ceil(n / dp_size)``.
    The shuffle is seeded by ``seed + epoch``, matching ``DistributedSampler`` index for index.
    """
    _check_shard(n, dp_rank, dp_size)
    if shuffle:
        g = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(n, generator=g).tolist()
    else:
        order = list(range(n))
    total = _per_rank(n, dp_size, drop_last) * dp_size
    if total > n and n > 0:
        reps = math.ceil(total / n)
        order = (order * reps)[:total]  # pad by repeating from the front
    return order[:total][dp_rank::dp_size]


class ShardSampler(Sampler[int]):
    """A sampler over :func:`shard_indices`; call ``set_epoch`` each epoch to reshuffle."""

    def __init__(self, n: int, dp_rank: int, dp_size: int, **shard_kwargs: Any) -> None:
        self.n, self.dp_rank, self.dp_size = n, dp_rank, dp_size
        self.kwargs = dict(shard_kwargs)
        _check_shard(n, dp_rank, dp_size)
        self._len = _per_rank(n, dp_size, self.kwargs.get("drop_last", False))

    def set_epoch(self, epoch: int) -> None:
        self.kwargs["epoch"] = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(shard_indices(self.n, self.dp_rank, self.dp_size, **self.kwargs))

    def __len__(self) -> int:
        return self._len


def distributed_loader(
    dataset: Sequence[Any],
    batch_size: int,
    dp_rank: int,
    dp_size: int,
    *,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> DataLoader:
    """A ``DataLoader`` over this rank's shard of any indexable dataset.

    ``num_workers`` is always 0. Engines cannot use spawn-based workers with notebook-defined
    code: a spawned worker unpickles the dataset and ``collate_fn`` by importable name, and a
    class or function defined in a notebook cell lives in the engine's ``__main__``, which the
    worker does not have. Forked workers are no better, since they copy an engine that is running
    ZMQ and gloo threads. Loading in the rank's own process avoids both.
    Call ``loader.sampler.set_epoch(e)`` to reshuffle for a new epoch.
    """
    sampler = ShardSampler(
        len(dataset),
        dp_rank,
        dp_size,
        seed=seed,
        epoch=epoch,
        shuffle=shuffle,
        drop_last=drop_last,
    )
    return DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=0, collate_fn=collate_fn
    )

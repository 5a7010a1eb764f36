"""Rows from local files, shared out over data-parallel ranks, batched as every rank needs.

``load_rows`` reads JSON-lines (or CSV, parquet, text) files through HF ``datasets``
(``load_dataset("json", data_files=...)``: memory-mapped Arrow, so a rank holds no copy of the
file). ``shard_order`` deals a seeded permutation of the row indices round-robin: each dp rank a
disjoint share, together every row exactly once, the same on every run with the same seed.
Unlike ``loader.shard_indices`` (``DistributedSampler``'s rule) it never repeats rows to even
the shares: an evaluation must count each held-out row once.

Every rank must run the same number of micro-batches (each is a collective), while shares differ
by up to one row. ``eval_batches`` evens them with filler rows that carry no label (they add no
loss and no token to ``evaluate``); ``train_batches`` streams epochs and leaves out the
``n % dp`` rows left over in each epoch (a different few every epoch, as the order reshuffles).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kernels_runtime.data.packing import Example, filler_row, pad_rows

Batch = dict[str, torch.Tensor]


def load_rows(data_files: str | Sequence[str] | dict[str, Any], *, split: str = "train",
              builder: str = "json") -> Any:
    """The rows of local files as an HF ``datasets.Dataset`` (``builder`` "json" for .json and
    .jsonl, or "csv", "parquet", "text"); ``split`` picks one when ``data_files`` is a dict of
    splits, e.g. ``{"train": "train.jsonl", "test": "held_out.jsonl"}``."""
    try:
        from datasets import load_dataset
    except ImportError as err:
        raise ImportError("load_rows reads files through HF datasets: pip install datasets") \
            from err
    return load_dataset(builder, data_files=data_files, split=split)


def _check(dp_rank: int, dp_size: int) -> None:
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is out of range for dp_size={dp_size}")


def shard_order(n: int, dp_rank: int, dp_size: int, *, seed: int = 0,
                shuffle: bool = True) -> list[int]:
    """This dp rank's row indices among ``n``: ``perm[dp_rank::dp_size]`` of a permutation
    seeded by ``seed`` (the identity without ``shuffle``). Disjoint across ranks, complete
    together, ``ceil(n / dp_size)`` or one fewer each."""
    _check(dp_rank, dp_size)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist() \
        if shuffle else list(range(n))
    return order[dp_rank::dp_size]


def shard_rows(rows: Any, dp_rank: int, dp_size: int, *, seed: int = 0,
               shuffle: bool = True) -> Any:
    """This dp rank's share of ``rows`` (``shard_order``): a ``Dataset.select`` for an HF
    dataset, else a list."""
    order = shard_order(len(rows), dp_rank, dp_size, seed=seed, shuffle=shuffle)
    if hasattr(rows, "select"):
        return rows.select(order)
    return [rows[i] for i in order]


def eval_batches(examples: Sequence[Example], micro_batch_size: int, dp_rank: int,
                 dp_size: int, pad_id: int, *, multiple_of: int = 1) -> list[Batch]:
    """Every example once over all dp ranks, as padded micro-batches (``pad_rows``), the same
    number on every rank (``ceil(ceil(n / dp) / micro_batch_size)``), short ranks' last batches
    evened with unlabelled filler rows. No shuffle: an evaluation's result does not depend on
    the order."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    mine = [examples[i] for i in shard_order(len(examples), dp_rank, dp_size, shuffle=False)]
    per_rank = -(-len(examples) // dp_size)
    count = -(-per_rank // micro_batch_size)
    mine += [filler_row(pad_id)] * (count * micro_batch_size - len(mine))
    return [pad_rows(mine[i:i + micro_batch_size], pad_id, multiple_of=multiple_of)
            for i in range(0, len(mine), micro_batch_size)]


def train_batches(examples: Sequence[Example], micro_batch_size: int, dp_rank: int,
                  dp_size: int, pad_id: int, *, seed: int = 0, multiple_of: int = 1,
                  epochs: int | None = None) -> Iterator[Batch]:
    """Padded micro-batches of this rank's share, epoch after epoch (forever with ``epochs``
    None), reshuffled every epoch by ``seed + epoch``. Each epoch deals ``n // dp_size`` rows to
    every rank, so every rank yields the same number of micro-batches; the last of an epoch may
    be smaller (on every rank alike)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    per_rank = len(examples) // dp_size
    if per_rank == 0:
        raise ValueError(f"{len(examples)} examples cannot give each of {dp_size} dp ranks one")
    epoch = 0
    while epochs is None or epoch < epochs:
        order = shard_order(len(examples), dp_rank, dp_size, seed=seed + epoch)[:per_rank]
        for i in range(0, per_rank, micro_batch_size):
            rows = [examples[j] for j in order[i:i + micro_batch_size]]
            yield pad_rows(rows, pad_id, multiple_of=multiple_of)
        epoch += 1

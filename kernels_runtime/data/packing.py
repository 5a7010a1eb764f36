"""Tokenized examples into model batches: padding with attention masks, and sequence packing.

Examples are dicts of equal-length token lists, ``{"input_ids", "labels"}`` (``sft.py``), maybe
``position_ids``. ``pad_rows`` right-pads a list of them into one micro-batch of tensors.
``pack`` concatenates several short examples into rows of at most ``max_length`` tokens, so a
batch of chat turns is not mostly padding.

Packing and attention: the position ids restart at 0 with every packed example, and the label
of each example's first token is ``-100``, so no loss term predicts one example from the end of
another. But the attention mask of a packed row is all ones: with the eager and SDPA kernels
(what CPU ranks and this runtime's tensor-parallel attention run) a token still *attends* to the
earlier examples of its row. Only flash-attention-2 with ``position_ids`` (transformers' packed
"varlen" path) separates them. Packing is exact for the labels and an approximation for the
context; leave it off (``pad_rows`` only) where per-example results must match unpacked ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

IGNORE_INDEX = -100
Example = dict[str, list[int]]


def _length(example: Example, i: int) -> int:
    n = len(example["input_ids"])
    if len(example["labels"]) != n:
        raise ValueError(f"example {i} has {n} input_ids but {len(example['labels'])} labels")
    return n


def pack(examples: Sequence[Example], max_length: int) -> list[Example]:
    """Concatenate examples, in order, into rows of at most ``max_length`` tokens.

    A row is closed when the next example does not fit (greedy, order kept, so packing is
    deterministic and every token keeps its example's order). Each row gets ``position_ids``
    restarting at 0 per example and ``-100`` as the label of each example's first token.
    An example longer than ``max_length`` is an error: cut it first (``chat_example``'s
    ``max_length``)."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    rows: list[Example] = []
    row: Example = {"input_ids": [], "labels": [], "position_ids": []}
    for i, example in enumerate(examples):
        n = _length(example, i)
        if n > max_length:
            raise ValueError(f"example {i} has {n} tokens, more than max_length={max_length}; "
                             "cut the examples to max_length first or raise it")
        if n == 0:
            continue
        if len(row["input_ids"]) + n > max_length:
            rows.append(row)
            row = {"input_ids": [], "labels": [], "position_ids": []}
        row["input_ids"] += example["input_ids"]
        row["labels"] += [IGNORE_INDEX] + list(example["labels"][1:])
        row["position_ids"] += list(range(n))
    if row["input_ids"]:
        rows.append(row)
    return rows


def filler_row(pad_id: int) -> Example:
    """A one-token row with no label: what makes ranks' batch counts equal without adding a
    loss term. It is attended (mask 1), so no attention row is fully masked."""
    return {"input_ids": [pad_id], "labels": [IGNORE_INDEX], "filler": [1]}


def pad_rows(rows: Sequence[Example], pad_id: int, *, length: int | None = None,
             multiple_of: int = 1) -> dict[str, torch.Tensor]:
    """Right-pad ``rows`` into one micro-batch: ``input_ids``, ``labels`` (``-100`` on padding),
    ``attention_mask`` (0 on padding) and ``position_ids`` when the rows have them, each
    ``(len(rows), s)``. ``s`` is ``length``, else the longest row rounded up to
    ``multiple_of`` (sequence parallelism needs ``s`` divisible by its degree)."""
    if not rows:
        raise ValueError("pad_rows needs at least one row")
    longest = max(_length(r, i) for i, r in enumerate(rows))
    s = length if length is not None else -(-longest // multiple_of) * multiple_of
    if longest > s:
        raise ValueError(f"a row has {longest} tokens, more than length={s}")
    positions = any("position_ids" in r for r in rows)
    ids = torch.full((len(rows), s), pad_id, dtype=torch.long)  # (b, s)
    labels = torch.full((len(rows), s), IGNORE_INDEX, dtype=torch.long)  # (b, s)
    mask = torch.zeros((len(rows), s), dtype=torch.long)  # (b, s)
    pos = torch.zeros((len(rows), s), dtype=torch.long)  # (b, s)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"], dtype=torch.long)
        labels[i, :n] = torch.tensor(r["labels"], dtype=torch.long)
        mask[i, :n] = 1
        pos[i, :n] = torch.tensor(r.get("position_ids", range(n)), dtype=torch.long)
        pos[i, n:] = torch.arange(n, s)  # padding continues the positions
        if r.get("filler"):
            mask[i] = 1  # a filler row is attended everywhere: no fully masked attention row
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    if positions:
        batch["position_ids"] = pos
    return batch


def counted_tokens(batch: Any) -> int:
    """Tokens a next-token loss counts in a batch: labels after the first position that are not
    ``-100`` (the shift drops each row's first label). For a dict batch or ``(ids, labels)``."""
    labels = batch["labels"] if isinstance(batch, dict) else batch[1]
    return int((labels[..., 1:] != IGNORE_INDEX).sum())

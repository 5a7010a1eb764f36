"""One step's tokens as a single flat sequence, and where each one's keys live in the cache.

A step mixes decodes (one token each) and prompt chunks of different lengths. Rather than pad
them into a rectangle, the model sees one row of ``T`` tokens, ``(1, T)``, each with its own
position, so the embeddings, projections and MLPs run once over exactly the tokens that need
computing. Only attention must know which tokens belong together; ``StepBatch`` tells it:

- ``slots`` (T,): the cache slot each new token's keys and values are written to;
- one ``Span`` per sequence: its queries' range in the row and its keys in the cache, a slice
  when its blocks are consecutive (read in place) or its slots otherwise (gathered), with the
  mask a chunk after cached tokens needs (it sees the cache before it and itself causally).

``sample_index`` holds the row index of the last token of every chunk that reaches the end of its
sequence's known tokens: only there are logits computed (``logits_to_keep``) and a token sampled.
A sequence carrying ``k`` speculative drafts (``speculation.py``) keeps the logits of its last
``k + 1`` rows instead, one per draft to verify and one for the token after them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels_runtime.inference.sequence import Sequence


@dataclass
class Span:
    start: int  # the sequence's queries are rows [start, start + n) of the step
    n: int
    length: int  # it attends to its first ``length`` tokens' keys
    first_slot: int | None  # its keys are slots [first_slot, first_slot + length) ...
    slots: torch.Tensor | None  # ... or these (length,) slots (blocks not consecutive)
    mask: torch.Tensor | None  # (n, length) bool for a chunk; None for one query

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.n)


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # (1, T)
    positions: torch.Tensor  # (1, T)
    slots: torch.Tensor  # (T,)
    sample_index: torch.Tensor  # (R,) rows whose logits are kept, R = sum(rows)
    sampled: list[Sequence]  # the S sequences that get a new token, in sample_index order
    spans: list[Span]
    rows: list[int]  # (S,) logits rows of each sampled sequence (1, or drafts + 1)
    adapters: torch.Tensor | None = None  # (T,) each token's LoRA adapter slot; None: all base

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def per_sequence(self, flat: list | None) -> list[list]:
        """Per-row values (R) cut into each sampled sequence's ``rows``; Nones for None."""
        if flat is None:
            return [[None] * n for n in self.rows]
        out, at = [], 0
        for n in self.rows:
            out.append(flat[at:at + n])
            at += n
        return out


def _span(seq: Sequence, row: int, begin: int, end: int, block_size: int,
          device: torch.device) -> tuple[Span, torch.Tensor]:
    """The span of ``seq``'s tokens [begin, end) and the slots they are written to."""
    blocks = seq.blocks[:-(-end // block_size)]
    first = blocks[0]
    consecutive = blocks == list(range(first, first + len(blocks)))
    if consecutive:
        new = torch.arange(first * block_size + begin, first * block_size + end)
        every = None
    else:
        table = torch.tensor(blocks, dtype=torch.long)
        every = (table[:, None] * block_size + torch.arange(block_size)).flatten()[:end]
        new = every[begin:]
    n = end - begin
    mask = None
    if n > 1:
        positions = torch.arange(begin, end)
        mask = (torch.arange(end)[None, :] <= positions[:, None]).to(device)  # (n, L)
    span = Span(row, n, end, first * block_size if consecutive else None,
                None if every is None else every.to(device), mask)
    return span, new


def build_batch(chunks: list[tuple[Sequence, int]], block_size: int,
                device: torch.device) -> StepBatch:
    ids: list[int] = []
    positions, slots, spans, sample_index, sampled = [], [], [], [], []
    row, adapters, rows = 0, [], []
    for seq, n in chunks:
        begin, end = seq.computed, seq.computed + n
        ids += seq.tokens[begin:end]
        adapters += [seq.adapter] * n
        positions.append(torch.arange(begin, end))
        span, new = _span(seq, row, begin, end, block_size, device)
        spans.append(span)
        slots.append(new)
        if end == len(seq.tokens):
            keep = seq.drafted + 1  # a chunk holds its drafts (speculation.fit)
            sample_index += range(row + n - keep, row + n)
            sampled.append(seq)
            rows.append(keep)
        row += n
    return StepBatch(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),
        positions=torch.cat(positions)[None].to(device),
        slots=torch.cat(slots).to(device),
        sample_index=torch.tensor(sample_index, dtype=torch.long, device=device),
        sampled=sampled, spans=spans, rows=rows,
        adapters=torch.tensor(adapters, device=device) if any(a >= 0 for a in adapters) else None)

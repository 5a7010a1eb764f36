"""One step's tokens as a single flat sequence, and where each one's keys live in the cache.

A step mixes decodes (one token each) and prompt chunks of different lengths. Rather than pad
them into a rectangle, the model sees one row of ``T`` tokens, ``(1, T)``, each with its own
position, so the embeddings, projections and MLPs run once over exactly the tokens that need
computing. Only attention must know which tokens belong together; ``StepBatch`` tells it:

- ``slots`` (T,): the cache slot each new token's keys and values are written to;
- decodes, attended together: one query each, over its sequence's slots padded to the longest
  (``decode_slots`` (B, L), ``decode_valid`` (B, L));
- prompt chunks, attended one by one: their query range in the row, their sequence's slots and
  which keys each query sees (a chunk sees the cache before it and itself causally).

``sample_index`` holds the row index of the last token of every chunk that reaches the end of its
sequence's known tokens: only there are logits computed (``logits_to_keep``) and a token sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels_runtime.inference.sequence import Sequence


@dataclass
class PromptChunk:
    start: int  # query range in the row: [start, start + n)
    n: int
    slots: torch.Tensor  # (L,) slots of the sequence's first L tokens, this chunk's included
    fresh: bool  # no cache before it: plain causal attention over the chunk itself
    mask: torch.Tensor | None  # (n, L) bool, query i sees key j when j <= its position


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # (1, T)
    positions: torch.Tensor  # (1, T)
    slots: torch.Tensor  # (T,)
    sample_index: torch.Tensor  # (S,)
    sampled: list[Sequence]  # the S sequences that get a new token, in sample_index order
    decode_index: torch.Tensor | None = None  # (B,) row index of each decode query
    decode_slots: torch.Tensor | None = None  # (B, L)
    decode_valid: torch.Tensor | None = None  # (B, L) bool
    prompts: list[PromptChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def _slots(seq: Sequence, length: int, block_size: int) -> torch.Tensor:
    """Cache slots of ``seq``'s first ``length`` tokens."""
    blocks = torch.tensor(seq.blocks[:-(-length // block_size)], dtype=torch.long)
    every = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
    return every[:length]


def build_batch(chunks: list[tuple[Sequence, int]], block_size: int,
                device: torch.device) -> StepBatch:
    ids, pos, slots, sample_index, sampled = [], [], [], [], []
    decodes: list[tuple[int, torch.Tensor]] = []
    prompts: list[PromptChunk] = []
    row = 0
    for seq, n in chunks:
        begin, end = seq.computed, seq.computed + n
        ids += seq.tokens[begin:end]
        positions = torch.arange(begin, end)
        pos.append(positions)
        context = _slots(seq, end, block_size)
        slots.append(context[begin:])
        if n == 1 and begin > 0:
            decodes.append((row, context))
        else:
            mask = None if begin == 0 else torch.arange(end)[None, :] <= positions[:, None]
            prompts.append(PromptChunk(row, n, context.to(device), fresh=begin == 0,
                                       mask=None if mask is None else mask.to(device)))
        if end == len(seq.tokens):
            sample_index.append(row + n - 1)
            sampled.append(seq)
        row += n
    batch = StepBatch(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),
        positions=torch.cat(pos)[None].to(device),
        slots=torch.cat(slots).to(device),
        sample_index=torch.tensor(sample_index, dtype=torch.long, device=device),
        sampled=sampled, prompts=prompts)
    if decodes:
        longest = max(len(c) for _, c in decodes)
        table = torch.zeros(len(decodes), longest, dtype=torch.long)
        valid = torch.zeros(len(decodes), longest, dtype=torch.bool)
        for i, (_, context) in enumerate(decodes):
            table[i, :len(context)] = context
            valid[i, :len(context)] = True
        batch.decode_index = torch.tensor([r for r, _ in decodes], device=device)
        batch.decode_slots, batch.decode_valid = table.to(device), valid.to(device)
    return batch

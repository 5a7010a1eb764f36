"""The causal LM loss on sequence shards: no rank gathers the sequence or its logits.

Under sp each rank holds its tokens' hidden states; joining them for the head would give every
rank the (b, s, V) logits sp ranks only need a part of, which is where the memory of a long
sequence goes. So the loss is computed from each rank's logits against the labels shifted on
the whole sequence first (the label of a shard's last token is the next shard's first), then
picked at this rank's positions. Each rank returns sp times its tokens' sum over the global
count of labelled tokens: data parallelism averages the sp ranks as replicas, which makes the
gradient and the reported loss the whole sequence's mean.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernels_runtime.parallel.sequence.hf_attention import SequenceShard
from kernels_runtime.parallel.tensor.cross_entropy import local_logits, vocab_parallel_cross_entropy

IGNORE_INDEX = -100


def causal_lm_loss_sequence_parallel(model: nn.Module, shard: SequenceShard, sp: int,
                                     input_ids: torch.Tensor, labels: torch.Tensor,
                                     head: nn.Module | None = None, **inputs: Any) -> torch.Tensor:
    """This rank's share of the next-token loss (module docstring); ``head`` is a
    vocabulary-parallel LM head when tp splits it."""
    with shard.local():
        if head is not None:
            with local_logits(head):
                output = model(input_ids=input_ids, **inputs)
        else:
            output = model(input_ids=input_ids, **inputs)
    logits = output.logits if hasattr(output, "logits") else output  # (b, s/sp, V[/tp])
    shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)],
                        dim=1)  # (b, s): the label of position t is token t + 1
    target = shifted.index_select(1, shard.positions.to(labels.device)).reshape(-1)  # (b*s/sp,)
    count = (shifted != IGNORE_INDEX).sum().clamp(min=1)  # every rank holds all labels
    flat = logits.reshape(-1, logits.shape[-1])
    if head is not None:
        mean = vocab_parallel_cross_entropy(flat, target, head.vocab_start, head.vocab_held,
                                            head.comm, head.group, IGNORE_INDEX)
        total = mean * (target != IGNORE_INDEX).sum().clamp(min=1)
    else:
        total = nn.functional.cross_entropy(flat.float(), target, ignore_index=IGNORE_INDEX,
                                            reduction="sum")
    return total * sp / count

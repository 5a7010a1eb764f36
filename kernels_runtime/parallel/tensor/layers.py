"""1D tensor-parallel layers (Megatron-LM, Shoeybi et al. 2019), shapes per rank.

A transformer block's MLP is a column-parallel layer (output features split: each rank
computes its slice, no communication) followed by a row-parallel one (input features split:
each rank computes a partial sum, one all-reduce). Attention is the same with q, k, v column-
parallel by heads and the output projection row-parallel. So a block costs one all-reduce of
its output in forward (g) and one of its input gradient in backward (f), per MLP and per
attention. Embeddings and the LM head split the vocabulary.

The weights are given already cut (``sharding.py``); ``transposed`` marks GPT-2's ``Conv1D``
storage, (in, out) instead of ``nn.Linear``'s (out, in).

Column-parallel layers fed the same tensor (q, k and v; gate and up) enter the tp region once:
they share an ``enter`` (``SharedEntry``), so backward all-reduces their summed input gradient
once, not once per layer. Under Megatron sequence parallelism (``parallel/sequence/
split_gather.py`` sets it) that entry is an all-gather along the sequence (or was done by the
enclosing attention module: ``input_gathered``), whose backward reduce-scatters; a row-parallel
layer then reduce-scatters its output along the sequence instead of all-reducing it
(``scatter_output``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

from kernels_runtime.comm import Collectives
from kernels_runtime.comm.autograd import (
    copy_to_group,
    gather_from_group,
    reduce_from_group,
    reduce_scatter_to_group,
)

SEQUENCE_DIM = 1  # hidden states are (b, s, h)


class SharedEntry:
    """Enter a tp region once per input tensor: the first layer given ``x`` runs ``enter(x)``
    (``copy_to_group``, or a sequence all-gather), the next layers given the same ``x`` reuse
    its result. Only the source is held weakly; the result is dropped by ``clear`` (at every
    block's start and the model's end), so no step's tensors outlive it."""

    def __init__(self, enter: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.enter = enter
        self._source: weakref.ref | None = None
        self._out: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._source is not None and self._source() is x and self._out is not None:
            return self._out
        out = self.enter(x)
        self._source, self._out = weakref.ref(x), out
        return out

    def clear(self, *_: object) -> None:
        self._source, self._out = None, None


def enter_column(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The input of a column-parallel layer: replicated (1D) or gathered along the sequence."""
    if layer.input_gathered:
        return x
    if layer.enter is not None:
        return layer.enter(x)  # shared: (b, s, h), or (b, s/tp, h) -> (b, s, h) under SP
    return copy_to_group(x, layer.comm, layer.group)


def _matmul(x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    return x @ weight if transposed else x @ weight.t()


class ColumnParallelLinear(nn.Module):
    """y[..., shard] = x W[:, shard]: input replicated, output split over tp."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Collectives,
                 group, transposed: bool = False, gather_output: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # (out/tp, in), or (in, out/tp) transposed
        self.bias = nn.Parameter(bias) if bias is not None else None  # (out/tp,)
        self.comm, self.group = comm, group
        self.transposed, self.gather_output = transposed, gather_output
        self.enter: SharedEntry | None = None  # shared with layers fed the same input
        self.input_gathered = False  # gathered by the enclosing module (sequence parallel)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The local matmul alone (a zero-bubble pipeline defers its weight gradient)."""
        return _matmul(x, self.weight, self.transposed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_column(self, x)  # (b, s, in), replicated
        y = self.project(x)  # (b, s, out/tp)
        if self.bias is not None:
            y = y + self.bias
        if self.gather_output:
            y = gather_from_group(y, self.comm, self.group, y.dim() - 1)  # (b, s, out)
        return y


class ReplicatedHeadsLinear(nn.Module):
    """A key or value projection when tp exceeds the key/value heads (grouped-query attention,
    as vLLM replicates them for inference): every rank holds the whole weight and keeps the
    output rows of the one head its query heads share. Ranks sharing a head each contribute
    the gradient from their own query heads, so the weight's gradient is summed over tp
    (``copy_to_group`` on the weight), and the whole weight stays replicated: data
    parallelism and checkpoints treat it like a norm's."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Collectives,
                 group, start: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # (kv * d, in), whole
        self.bias = nn.Parameter(bias) if bias is not None else None  # (kv * d,)
        self.comm, self.group = comm, group
        self.start, self.width = start, width  # this rank's head: output rows [start, +width)
        self.enter: SharedEntry | None = None  # shared with layers fed the same input
        self.input_gathered = False  # gathered by the enclosing module (sequence parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_column(self, x)  # (b, s, in), replicated
        weight = copy_to_group(self.weight, self.comm, self.group).narrow(0, self.start,
                                                                          self.width)
        y = x @ weight.t()  # (b, s, d): one key/value head
        if self.bias is not None:
            y = y + copy_to_group(self.bias, self.comm, self.group).narrow(0, self.start,
                                                                            self.width)
        return y


class VocabParallelHead(ColumnParallelLinear):
    """An LM head split over the vocabulary: this rank holds rows [start, start + held) of a
    vocabulary of ``vocab`` (its slice padded to ceil(vocab/tp) rows). It gathers the logits
    and drops every rank's padding, so outputs have the full (.., vocab) shape; with
    ``gather_output`` off (a vocabulary-parallel loss) it returns this rank's padded slice."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Collectives,
                 group, start: int, held: int, vocab: int, transposed: bool = False) -> None:
        super().__init__(weight, bias, comm, group, transposed, gather_output=True)
        self.vocab_start, self.vocab_held, self.vocab_size = start, held, vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)  # (b, s, V/tp padded) or gathered (b, s, tp * V/tp padded)
        per_rank = self.weight.shape[1 if self.transposed else 0]
        if not self.gather_output or y.shape[-1] == self.vocab_size:
            return y
        chunks = y.split(per_rank, dim=-1)  # tp x (b, s, V/tp padded)
        kept = [c[..., :max(0, min(per_rank, self.vocab_size - r * per_rank))]
                for r, c in enumerate(chunks)]
        return torch.cat(kept, dim=-1)  # (b, s, V)


class RowParallelLinear(nn.Module):
    """y = sum over tp of x[..., shard] W[shard, :], then the (replicated) bias once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Collectives,
                 group, transposed: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # (out, in/tp), or (in/tp, out) transposed
        self.bias = nn.Parameter(bias) if bias is not None else None  # (out,), replicated
        self.comm, self.group = comm, group
        self.transposed = transposed
        self.scatter_output = False  # sequence parallelism: reduce-scatter along s

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The local matmul alone (a zero-bubble pipeline defers its weight gradient)."""
        return _matmul(x, self.weight, self.transposed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.project(x))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over tp of this rank's share (b, s, out), then the bias once (a LoRA
        adapter adds its own share first: ``lora.py``)."""
        if not self.scatter_output:
            y = reduce_from_group(partial, self.comm, self.group)  # (b, s, out)
            return y + self.bias if self.bias is not None else y
        y = reduce_scatter_to_group(partial, self.comm, self.group, SEQUENCE_DIM)  # (b, s/tp, out)
        if self.bias is None:
            return y
        return y + copy_to_group(self.bias, self.comm, self.group)  # each rank: its tokens' grad


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + held) of the vocabulary on this rank (padded rows are zeros);
    a token outside them looks up zeros, and the sum over tp is the full embedding.

    ``padding_idx`` is ``nn.Embedding``'s, in the whole vocabulary: the rank holding that row
    never gives it a gradient (BERT's [PAD] row stays as loaded, issue 24); other attributes
    of ``nn.Embedding`` are refused before the swap (``attributes.py``)."""

    def __init__(self, weight: torch.Tensor, start: int, held: int, comm: Collectives,
                 group, padding_idx: int | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # (ceil(V/tp), h)
        self.start, self.held = start, held
        self.comm, self.group = comm, group
        self.padding_idx = padding_idx
        mine = padding_idx is not None and start <= padding_idx < start + held
        self.local_padding_idx = padding_idx - start if mine else None  # row in this shard

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.start + self.held)  # (b, s)
        local = torch.where(outside, torch.zeros_like(ids), ids - self.start)
        out = nn.functional.embedding(local, self.weight,  # (b, s, h)
                                      padding_idx=self.local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_group(out, self.comm, self.group)  # (b, s, h)


class PartialGradModule(nn.Module):
    """A replicated module whose input differs across the tp group (a norm on sequence shards,
    a per-head norm on this rank's heads): each rank's gradient of its parameters covers only
    its part, so they enter through ``copy_to_group`` and the sum over tp is what every rank
    accumulates. Its own parameters move onto this wrapper under the same names (checkpoints
    and state dicts do not change) and its submodules are registered here too, so every path
    stays; the wrapped module runs on them with ``functional_call``. ``group`` may be several
    groups (a grid's column and depth), summed over in turn."""

    def __init__(self, inner: nn.Module, comm: Collectives, group) -> None:
        super().__init__()
        self.comm = comm
        self.groups = tuple(group) if isinstance(group, (tuple, list)) else (group,)
        for name, child in inner.named_children():
            self.add_module(name, child)
        for name, p in list(inner.named_parameters(recurse=False)):
            del inner._parameters[name]
            self.register_parameter(name, p)
        self.inner = (inner,)  # a tuple, set last: not a submodule, so names stay the same

    def forward(self, *args, **kwargs):
        params = {}
        for name, p in self.named_parameters(recurse=False):
            for group in self.groups:
                p = copy_to_group(p, self.comm, group)
            params[name] = p
        return torch.func.functional_call(self.inner[0], params, args, kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("inner")
            if inner is None:
                raise
            return getattr(inner[0], name)  # eps, normalized_shape, ...

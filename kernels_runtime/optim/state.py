"""Model state as pieces of n-D shards, owned by whoever lays the state out.

A checkpoint, an in-memory ``state_dict`` and an inference loader all ask one question of a
parallelized model: which boxes of which tensors does this rank hold, and where do they live.
The strategy that laid the state out (``GradSync`` of a data-parallel strategy, or a model-only
layout from ``parallelize_model``) answers it with ``StatePiece``s: a ``Shard`` (the box, in
global coordinates) and, per state key, a tensor of the box's sizes that is a view of the live
storage, so loading is ``view.copy_(saved)`` and saving reads the views.

Keys: ``"param"`` is the parameter's value at its best precision (the fp32 master when training
in 16 bit, the parameter itself otherwise); optimizer states keep the optimizer's own names
(``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ...).

Two lists per layout: the pieces a rank *writes* (each element of each tensor written by exactly
one rank; replicas split a replicated box among themselves so they write in parallel) and the
pieces it *holds* (everything it must fill on load).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kernels_runtime.mesh.shards import ParamLayout, Shard, split_box

PARAM = "param"


@dataclass
class StatePiece:
    shard: Shard
    values: dict[str, torch.Tensor] = field(default_factory=dict)  # each shaped shard.sizes


class ModelState(Protocol):
    """What a checkpoint needs from a layout (see the module docstring)."""

    def pieces(self, saving: bool, optimizer: torch.optim.Optimizer | None) -> list[StatePiece]:
        """Written (``saving``) or held pieces; optimizer states of ``optimizer`` included
        when it is given."""
        ...

    def after_load(self) -> None:
        """Propagate loaded values where they are used (masters to parameters, shards to
        every replica)."""
        ...


def state_views(optimizer: torch.optim.Optimizer | None, master: torch.Tensor,
                view: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The optimizer's per-element states of ``master`` (those of its shape), each through
    ``view`` (the same slicing that made the piece's parameter view)."""
    if optimizer is None:
        return {}
    state = optimizer.state.get(master, {})
    return {k: view(v) for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.shape == master.shape and v.dim() > 0}


def replica_index(coords: dict[str, int], sizes: dict[str, int],
                  replicated: list[str]) -> tuple[int, int]:
    """(this rank's index, number of replicas) among the ranks holding the same values: the
    row-major index of its coordinates along the axes it is replicated over."""
    index, count = 0, 1
    for axis in replicated:
        index = index * sizes[axis] + coords[axis]
        count *= sizes[axis]
    return index, count


def layout_replica(layout: ParamLayout, coords: dict[str, int], sizes: dict[str, int],
                   replicated: list[str]) -> tuple[int, int]:
    """``replica_index`` over the axes a layout is replicated along, combined with its own
    replicas inside the sharded axes (``ParamLayout.replica``)."""
    index, count = replica_index(coords, sizes, replicated)
    inner, inner_count = layout.replica
    return index * inner_count + inner, count * inner_count


def written_part(offsets: tuple[int, ...], sizes: tuple[int, ...], index: int,
                 count: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The part of a replicated box that replica ``index`` of ``count`` writes."""
    if count == 1:
        return offsets, sizes
    return split_box(offsets, sizes, count, index)

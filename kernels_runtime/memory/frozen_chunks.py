"""Frozen parameters (``requires_grad`` False: a LoRA model's base) as weights-only chunks.

Why chunks at all: under ``offload=...`` the frozen base is most of the model's bytes, and left
out of the chunks it would stay wherever it was built. As chunks of their own (never mixed with
trainable parameters: a separate group, ``ChunkLayout.frozen``) they are placed by the same
placer as parameters (host or disk), gathered to the device for a unit's forward and again for
its backward (the gradient of the unit's input and of the adapters before them flows through
them), and released after. They have a ``param`` payload only: no gradient buffer, no
reduction, no master, no optimizer state, no checkpoint pieces (a checkpoint holds what trains;
the base comes from its pretrained files, as without offload). Under zero 3 the ``param`` is
this rank's shard, all-gathered when computing, exactly as a trainable chunk's (and as the
weights of ``parallelize_model``): the gather path is one, and dp ranks hold 1/dp of the base.

When a unit's backward is over: a trainable chunk knows (its last gradient arrived), a frozen
one cannot. So a unit's frozen chunks are released once (1) every input of its forward that
requires a gradient has received it (a hook per input tensor: nothing before the input needs
the unit's weights) and (2) every trainable chunk the unit uses is reduced. What is still held
at the end of backward (an input whose gradient never came) is released there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kernels_runtime.memory.chunk_table import BackwardPass, ChunkTable

Named = list[tuple[str, nn.Parameter]]


def frozen_named_params(model: nn.Module, groups: list[Named]) -> Named:
    """The model's floating-point parameters that are in no trainable group (each once)."""
    trainable = {id(p) for g in groups for _, p in g}
    return [(n, p) for n, p in model.named_parameters()
            if id(p) not in trainable and not p.requires_grad and p.is_floating_point()]


def in_backward() -> bool:
    """Inside autograd's backward (a checkpointed block re-running its forward there)."""
    return torch._C._current_graph_task_id() != -1


def tensors_in(value: object) -> list[torch.Tensor]:
    """Every tensor in a module's inputs or outputs (tuples, lists, dicts, HF ModelOutput)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    if hasattr(value, "to_tuple"):  # HF ModelOutput
        return tensors_in(value.to_tuple())
    return []


class FrozenRelease:
    """When the frozen chunks of ``ChunkGradSync`` go (module docstring): given the chunk
    table, the backward in progress (``chunk_table.py``) and ``release(i)``, which releases
    chunk ``i``'s gathered parameters."""

    def __init__(self, table: ChunkTable, backward: BackwardPass,
                 release: Callable[[int], None]) -> None:
        self.backward, self._release = backward, release
        units, chunks = table.units, table.chunks
        self._units = units
        self._unit_frozen = [[i for i in u.chunks if chunks[i].frozen] for u in units]
        self._unit_trainable = [[i for i in u.chunks if not chunks[i].frozen] for u in units]
        self._users = {c.index: [u for u, unit in enumerate(units) if c.index in unit.chunks]
                       for c in chunks}
        self._inputs_waiting = [0] * len(units)  # input gradients still to come
        self._frozen_holders: dict[int, set[int]] = {}  # chunk -> units whose backward needs it

    def install_hooks(self) -> None:
        """A forward pre-hook on every unit with frozen chunks (``_watch_inputs``)."""
        for u, unit in enumerate(self._units):
            if self._unit_frozen[u]:
                unit.module.register_forward_pre_hook(
                    lambda m, args, kwargs, u=u: self._watch_inputs(u, args, kwargs),
                    with_kwargs=True)

    def _watch_inputs(self, u: int, args: tuple, kwargs: dict) -> None:
        """A forward that will have a backward: count the unit's inputs whose gradient marks
        the end of its backward (a checkpointed block recomputing inside backward adds none)."""
        if in_backward() or not torch.is_grad_enabled():
            return
        for t in tensors_in(args) + tensors_in(kwargs):
            if t.requires_grad:
                self._inputs_waiting[u] += 1
                t.register_hook(lambda g, u=u: self._input_grad_ready(u))

    def _input_grad_ready(self, u: int) -> None:
        self._inputs_waiting[u] = max(0, self._inputs_waiting[u] - 1)
        self._release_frozen_of(u)

    def hold(self, u: int) -> None:
        """Unit ``u``'s backward starts: its frozen chunks (just gathered) stay for it."""
        for i in self._unit_frozen[u]:
            self._frozen_holders.setdefault(i, set()).add(u)

    def after_reduce(self, i: int) -> None:
        """Trainable chunk ``i`` is reduced: a unit using it may be done with its weights."""
        for u in self._users.get(i, ()):
            self._release_frozen_of(u)

    def _release_frozen_of(self, u: int) -> None:
        b = self.backward
        if u not in b.fetched or self._inputs_waiting[u] > 0:
            return
        if any(i not in b.reduced for i in self._unit_trainable[u]):
            return
        for i in self._unit_frozen[u]:
            holders = self._frozen_holders.get(i)
            if not holders or u not in holders:
                continue
            holders.discard(u)
            if not holders and not b.active[i]:
                del self._frozen_holders[i]
                b.held.discard(i)
                self._release(i)

    def end_backward(self) -> None:
        """The backward is over (``ChunkGradSync`` releases what is still held)."""
        self._frozen_holders.clear()
        self._inputs_waiting = [0] * len(self._units)

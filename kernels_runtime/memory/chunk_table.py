"""The state the parts of ``ChunkGradSync`` share, as two objects each part is given.

Why objects and not a class spread over files: the gradient reducer (``chunk_grads.py``), the
stepper (``chunk_step.py``), its deferred steps (``deferred_step.py``) and the frozen release
(``frozen_chunks.py``) all read the chunk layout and its payloads, and the first and last also
what the forward and backward in progress hold. Each receives these here, explicitly, in its
constructor; whatever else a part reads it sets itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels_runtime.memory.chunks import ChunkLayout, Unit
from kernels_runtime.memory.placement import Placer
from kernels_runtime.memory.tiers import Payload, Tier, TierStore
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.shards import ParamLayout


@dataclass(eq=False)
class ChunkTable:
    """The chunks, their payloads per chunk index, and where those live (``chunk_sync.py``'s
    module docstring has the table of payloads)."""

    ctx: ParallelContext
    stage: int  # ZeRO stage: 2 (``param`` is the whole chunk) or 3 (this rank's shard)
    dtype: torch.dtype  # of the parameters (compute dtype)
    layouts: dict[str, ParamLayout]  # by parameter name, trainable and frozen
    units: list[Unit]
    chunks: list[ChunkLayout]
    store: TierStore
    placer: Placer
    param: list[Payload] = field(default_factory=list)
    master: list[Payload] = field(default_factory=list)  # ``param`` itself when they agree
    grad: list[Payload | None] = field(default_factory=list)  # None: no gradient this step
    states: list[dict[str, Payload]] = field(default_factory=list)  # the optimizer's, by name
    grad_homes: list[Tier] | None = None  # static placement only
    host_left: list[float] | None = None  # host bytes the optimizer's states may still take
    prefix: str = ""  # of payload keys: two tables may share one store and placer (under ep)

    def __post_init__(self) -> None:
        self.grad = [None] * len(self.chunks)
        self.states = [{} for _ in self.chunks]

    @property
    def dp(self) -> int:
        return self.ctx.dp_size

    @property
    def dp_rank(self) -> int:
        return self.ctx.dp_rank

    def key(self, i: int, kind: str) -> str:
        """The store's and placer's name of chunk ``i``'s ``kind`` payload (``param``,
        ``grad``, ``master``, an optimizer state's name, ``whole``)."""
        return f"{self.prefix}c{i}.{kind}"

    def is_whole(self, i: int) -> bool:
        """The ``param`` payload is the whole chunk (zero 2, or a single dp rank)."""
        return self.stage == 2 or self.dp == 1


@dataclass(eq=False)
class BackwardPass:
    """Which chunks the forward and backward in progress use, per chunk index (``units``
    fetched: unit indices)."""

    active: list[int]  # units inside their forward that need the chunk
    held: set[int] = field(default_factory=set)  # gathered for backward, gradients to come
    reduced: set[int] = field(default_factory=set)  # gradient reduced in this backward
    fetched: set[int] = field(default_factory=set)  # units whose backward gathered their chunks

    def end(self) -> None:
        """The backward is over (what was held has been released)."""
        self.held.clear()
        self.fetched.clear()
        self.reduced.clear()

"""What every cost term reads (``Setting``) and what it returns (``MemoryItem``, ``TimeItem``).

A term is a plain function ``Setting -> list[item]``. Keeping terms this small and uniform is
what lets tensor, pipeline and sequence parallelism, offloading and inference join later as new
functions in the lists of ``cost_model.py`` without touching the existing ones.

Under pipeline parallelism ranks differ, so a ``Setting`` describes one pipeline rank
(``pp_rank``), or one of its model chunks (``chunk``): its blocks (``layers``), whether it holds
the embeddings (``has_embedding``) and the head (``has_head``), and its parameters. The blocks
of each virtual stage are the runtime's own split (``kernels_runtime.parallel.pipeline``:
equal blocks balanced over pp x chunks stages, placed by the schedule's ``Placement``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

from kernels_runtime.mesh.plan import Plan, PlanError
from kernels_runtime.mesh.validation import pipeline_chunks
from kernels_runtime.parallel.pipeline.partition import partition
from kernels_runtime.parallel.pipeline.schedules import Placement
from workbench.planner.hardware import HardwareProfile
from workbench.planner.spec import ModelSpec

ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")
TIERS = ("device", "host", "disk")


@lru_cache(maxsize=256)
def stage_blocks(layers: int, stages: int) -> tuple[range, ...]:
    """Blocks of each virtual stage: the runtime's partition of equal blocks (``partition``)."""
    return tuple(partition([1.0] * layers, stages))


@dataclass(frozen=True)
class Setting:
    """One rank's view of a plan. Derived shapes are cached on the instance (a frozen
    dataclass: ``replace`` makes a new one), since every term reads them."""

    plan: Plan  # validated: dp resolved
    spec: ModelSpec
    hw: HardwareProfile
    world: int
    pp_rank: int = 0  # the pipeline rank described (pp > 1)
    chunk: int | None = None  # one model chunk of that rank; None: all of them

    @property
    def dp(self) -> int:
        assert self.plan.dp is not None
        return self.plan.dp

    @property
    def microbatches(self) -> int:
        return self.plan.microbatches

    @property
    def tp(self) -> int:
        return self.plan.tp

    @property
    def grid(self) -> tuple[int, int] | None:
        """(q, d) of a 2D (d = 1) or 2.5D tensor-parallel grid, tp = d*q*q; None under 1D."""
        if self.plan.tp_mode == "1d":
            return None
        depth = self.plan.tp_depth if self.plan.tp_mode == "2.5d" else 1
        return math.isqrt(self.tp // depth), depth

    @property
    def sp(self) -> int:
        """Ranks the sequence is split over on the sp axis (Ulysses or ring attention)."""
        return self.plan.sp

    @property
    def data_ranks(self) -> int:
        """Ranks holding replicas of the same parameters: dp x sp. The runtime folds sp into
        the data axis (``ParallelContext.fold_sp``): ZeRO shards over it, gradients reduce
        over it."""
        return self.dp * self.sp

    # ---- pipeline stages -------------------------------------------------------------------
    @property
    def pp(self) -> int:
        return self.plan.pp

    @cached_property
    def chunks(self) -> int:
        """Model chunks per pipeline rank (V of interleaved, 2 under zbv, else 1)."""
        return pipeline_chunks(self.plan) if self.pp > 1 else 1

    @cached_property
    def placement(self) -> Placement:
        return Placement(self.pp, self.chunks, v_shape=self.plan.pp_schedule == "zbv"
                         and self.pp > 1)

    @cached_property
    def virtual_stages(self) -> tuple[int, ...]:
        """The virtual stages this setting covers: the rank's chunks, or the one chunk."""
        chunks = range(self.chunks) if self.chunk is None else (self.chunk,)
        return tuple(self.placement.stage(self.pp_rank, c) for c in chunks)

    @cached_property
    def layers(self) -> int:
        """Transformer blocks this setting computes and holds: all of them without a pipeline."""
        if self.pp == 1:
            return self.spec.layers
        ranges = stage_blocks(self.spec.layers, self.placement.stages)
        return sum(len(ranges[v]) for v in self.virtual_stages)

    @cached_property
    def has_embedding(self) -> bool:
        """Runs the embeddings (virtual stage 0)."""
        return self.pp == 1 or 0 in self.virtual_stages

    @cached_property
    def has_head(self) -> bool:
        """Runs the final norm, the output head and the loss (the last virtual stage)."""
        return self.pp == 1 or self.placement.stages - 1 in self.virtual_stages

    @property
    def sequence_parallel(self) -> bool:
        """Megatron sequence parallelism inside the tp group: what tp leaves whole (norms,
        dropout, residuals) is split over the sequence too."""
        return self.plan.sp_mode == "split_gather"

    @property
    def local_batch(self) -> int:
        try:
            return self.spec.local_batch(self.dp)
        except ValueError as err:
            raise PlanError(f"{err}; choose dp dividing the global batch") from None

    @property
    def micro_batch(self) -> int:
        b, m = self.local_batch, self.microbatches
        if b % m:
            raise PlanError(f"microbatches={m} does not divide the {b} samples per "
                            f"data-parallel rank; choose a divisor of {b}")
        return b // m

    @property
    def elem(self) -> int:
        """Bytes per value of the compute dtype (activations, 16-bit parameters)."""
        return ELEMENT_BYTES[self.plan.precision]

    @property
    def psi(self) -> int:
        """Parameters of the whole model."""
        return self.spec.param_count

    @cached_property
    def psi_local(self) -> float:
        """Parameters of this rank's tensor-parallel shard (under a pipeline: of its stages,
        whatever ``chunk``): what ZeRO shards further."""
        if self.grid is not None:
            return self.spec.grid_params_per_rank(self.grid[0])
        if self.pp > 1:
            rank = Setting(self.plan, self.spec, self.hw, self.world, self.pp_rank)
            return self.spec.stage_params_per_rank(self.tp, rank.layers, rank.has_embedding,
                                                   rank.has_head)
        return self.spec.params_per_rank(self.tp)

    @property
    def layer_params_local(self) -> float:
        """One block's parameters on this rank (1D shard or grid block)."""
        if self.grid is not None:
            return self.spec.grid_layer_params_per_rank(self.grid[0])
        return self.spec.layer_params_per_rank(self.tp)

    @property
    def embedding_params_local(self) -> float:
        if self.grid is not None:
            return self.spec.grid_embedding_params_per_rank(self.grid[0])
        return self.spec.embedding_params_per_rank(self.tp)

    @property
    def seq_local(self) -> float:
        """Tokens of one sample on this rank: the sequence split over sp."""
        return self.spec.seq / self.sp

    @property
    def tokens_per_micro(self) -> float:
        """Tokens one micro-batch puts on this rank."""
        return self.micro_batch * self.seq_local


@dataclass(frozen=True)
class MemoryItem:
    """Bytes per rank of one kind (``CATEGORIES``) in one tier (``TIERS``) at the step's peak.
    Model states and activations are checked against measurements; buffers are estimates."""

    category: str  # one of CATEGORIES
    bytes: float
    tier: str = "device"
    note: str = ""


@dataclass(frozen=True)
class TimeItem:
    """Seconds per optimizer step of one kind of work.

    ``phase`` places compute in the step (forward / backward / step); a communication item's
    ``window`` names the compute it may hide behind (``forward``, ``backward``, or
    ``backward_last``: only the last micro-batch's backward), None for fully exposed; ``count``
    is how many collectives it is made of (the last one cannot hide)."""

    name: str
    kind: str  # compute | comm | optimizer | overhead
    seconds: float
    phase: str = "step"
    window: str | None = None
    axis: str | None = None
    count: int = 1
    nbytes: float = 0.0
    note: str = ""

"""``ParallelState``: the record a parallelized model carries, filled in by the appliers.

``parallelize_model`` runs one applier per dimension in a fixed order (tensor, sequence,
activation checkpointing, pipeline, data, offload; ``kernels_runtime.api``). Each reads what
the earlier ones decided and adds its own part here, so a later dimension builds on the earlier
ones instead of rediscovering them: tensor parallelism records each parameter's ``ParamLayout``
(which box of the global tensor this rank holds), data parallelism shards on top of those
layouts and records the ``ModelState`` that checkpoints read and the ``GradSync`` the
optimizer steps through; a pipeline records its schedule. The record is stored on the model as
``model.parallel_state``, which is also how a second ``parallelize`` on the same model is
refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.shards import ParamLayout
from kernels_runtime.optim.state import ModelState
from kernels_runtime.optim.sync import GradSync
from kernels_runtime.policies.base import Policy

ATTRIBUTE = "parallel_state"


@dataclass
class ParallelState:
    ctx: ParallelContext
    policy: Policy
    optimizer: torch.optim.Optimizer | None = None  # the user's, when training
    bucket_mb: float = 8.0  # flat-bucket size of ZeRO 0-2
    spill_dir: str | None = None  # where offload's disk tier writes (memory.spill)
    chunk_mb: float = 32.0  # chunk size of offload's chunks
    layouts: dict[str, ParamLayout] = field(default_factory=dict)  # by parameter name
    blocks: list[nn.Module] = field(default_factory=list)
    grad_sync: GradSync | None = None  # set by the data applier when training
    model_state: ModelState | None = None  # set by the data applier
    schedule: Any = None  # a pipeline schedule; None: micro-batches in sequence
    vocab_head: str | None = None  # path of a vocabulary-parallel LM head (tensor parallel)
    sequence: Any = None  # the SequenceShard of sp_mode ring / all_to_all (sequence parallel)
    stage_carry: Any = None  # what pipeline stages pass besides the activation (ep's router sums)
    elsewhere: set[str] = field(default_factory=set)  # parameters other pipeline stages hold
    applied: list[str] = field(default_factory=list)  # appliers that changed the model
    replaced: list[tuple[str, str]] = field(default_factory=list)  # (module, what it became)
    # id of a parameter the user's optimizer was built over -> the model's new one (shards)
    replaced_params: dict[int, nn.Parameter] = field(default_factory=dict)

    def layout(self, name: str, param: torch.Tensor) -> ParamLayout:
        """The parameter's layout; an untouched parameter is replicated everywhere."""
        found = self.layouts.get(name)
        return found if found is not None else ParamLayout.replicated(tuple(param.shape))


def parallel_state(model: nn.Module) -> ParallelState | None:
    """The record of a model that ``parallelize_model`` changed, else None."""
    return model.__dict__.get(ATTRIBUTE)

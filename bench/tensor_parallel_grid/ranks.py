"""The rank side of ``python -m bench tensor_parallel_grid``: one HF LLaMA (the 1D bench's
``build_model``, same seed) under 1D and a grid plan at the same tp, and what is counted on it.

``GridMeter`` is the 1D bench's ``LayerMeter`` reading every group of ``comm.stats`` (tp,
tp_row, tp_col, tp_dep) instead of "tp" alone; readings are {(op, group): (calls, bytes)}.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bench.common.layer_meter import LayerMeter, LocalSavedActivations, wchar
from bench.common.timing import time_variants
from bench.tensor_parallel.ranks import (
    Variant,
    build_model,
    measure_step,
    ours_forward,
    token_batch,
)
from bench.tensor_parallel_grid.formulas import GridShape

PLANS = {"1D tp=4": "tp=4", "2D tp=4": "tp=4 tp_mode=2d",
         "1D tp=8": "tp=8", "2.5D tp=8": "tp=8 tp_mode=2.5d tp_depth=2"}


def _read(stats) -> tuple[int, dict]:
    counts = {}
    for op, groups in stats.snapshot().items():
        for group, c in groups.items():
            counts[(op, group)] = (int(c["calls"]), int(c["bytes"]))
    return wchar(), counts


class GridMeter(LayerMeter):
    """``LayerMeter`` over every process group: readings keyed (op, group)."""

    def read(self) -> tuple[int, dict]:
        return _read(self.stats)


def make_variant(name: str, shape: GridShape, comm) -> Variant | str:
    """Ours under ``PLANS[name]``, or why parallelize refused it."""
    from kernels_runtime import parallelize, train_step
    from kernels_runtime.mesh.context import ParallelContext

    plan = PLANS[name]
    model = build_model(shape)
    try:
        model, bopt = parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                                  ctx=ParallelContext.build(plan, comm), verbose=False)
    except Exception as err:  # a PlanError, or whatever else the applier raises: shown as is
        return f"{plan!r} refused: {type(err).__name__}: {err}"
    return Variant(model, ours_forward, bopt.backward,
                   lambda s: train_step(model, bopt, [(token_batch(shape, s),) * 2]).loss,
                   comm.stats)


def local_param_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameters (each tensor once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _comm(comm_for: Callable[[], Any] | None):
    from kernels_runtime.comm import Collectives

    return comm_for() if comm_for is not None else Collectives()


# ---- counting (no timing) -----------------------------------------------------------------
def count(rank: int, world: int, shape: GridShape, variants: tuple[str, ...],
          comm_for: Callable[[], Any] | None = None) -> dict:
    """Per variant, of one step: collective and socket bytes per block and pass (and per pass
    in all), bytes saved for backward per block and bytes of local parameters; or why the
    variant did not run. ``comm_for()`` gives the rank's ``Collectives`` (default: new)."""
    comm = _comm(comm_for)
    out: dict[str, Any] = {}
    for name in variants:
        variant = make_variant(name, shape, comm)
        out[name] = variant if isinstance(variant, str) else _count_one(variant, shape)
    return out


def _count_one(v: Variant, shape: GridShape) -> dict:
    return {**measure_step(v, token_batch(shape, 0), GridMeter),
            "params": local_param_bytes(v.model)}


def unsplit(shape: GridShape) -> dict:
    """The same model on one process: its parameter bytes and bytes saved per block."""
    from kernels_runtime.api.objective import causal_lm_loss

    model = build_model(shape)
    ids = token_batch(shape, 0)
    blocks = list(model.model.layers)
    with LocalSavedActivations(blocks) as saved:
        loss = causal_lm_loss(model, (ids, ids))
    loss.backward()
    return {"params": local_param_bytes(model),
            "saved": [saved.by_block[f"block{i}"] for i in range(len(blocks))]}


# ---- timing ---------------------------------------------------------------------------------
def timed(rank: int, world: int, shape: GridShape, rounds: int, steps: int,
          variants: tuple[str, ...], comm_for: Callable[[], Any] | None = None) -> dict:
    """Per variant: its first step's loss (same weights, same batch) and each round's median
    step time; each round runs ``steps`` steps of every variant, the order rotating."""
    comm = _comm(comm_for)
    return time_variants({name: make_variant(name, shape, comm) for name in variants},
                         rounds, steps)

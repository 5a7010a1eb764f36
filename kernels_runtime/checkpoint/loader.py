"""``load``: restore a checkpoint into a parallelized model and its ``BoostedOptimizer``, under
the plan it was saved with or any other (another zero stage, dp size or world size).

Everything that can fail is checked before the optimizer is touched, and the ranks agree on
the result: names and shapes against the model (the same verdict on every rank), then each
rank's coverage and the integrity of the files it will read. Only then does the optimizer
pull its ranges (``load_segments``), which ends in collectives that a failing rank must not
skip. RNG states come back only when the world size and plan are the saved ones: under another
layout rank r's stream has no counterpart.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kernels_runtime.api.optimizer import BoostedOptimizer
from kernels_runtime.checkpoint import format as fmt
from kernels_runtime.checkpoint.agreement import agree, attempt
from kernels_runtime.checkpoint.format import CheckpointError
from kernels_runtime.checkpoint.reader import CheckpointReader


def load(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: BoostedOptimizer,
    step: int | None = None,
    *,
    strict: bool = True,
) -> dict[str, Any]:
    """Load ``step`` (default: ``latest``) from ``directory``; collective.

    ``strict=False`` ignores parameters the checkpoint has and the model does not; parameters
    the optimizer holds must always be in it. Returns ``{"step", "extra", "plan",
    "world_size"}`` as saved.
    """
    step_dir = fmt.resolve_step_dir(directory, step)
    meta = fmt.read_meta(step_dir)
    check_parameters(meta, model, strict, str(step_dir))
    ctx = optimizer.ctx
    rank, world = dist.get_rank(), dist.get_world_size()
    same_layout = meta["world_size"] == world and meta["plan"] == ctx.plan.to_string()
    with CheckpointReader(step_dir, meta) as reader:

        def verify() -> None:
            files = reader.files_for(optimizer.needed_segments())
            if same_layout:
                files.add(fmt.rank_file_name(rank))
            for file in sorted(files):
                reader.verify(file)

        agree(ctx.comm, ctx.device, attempt(verify), f"verifying {step_dir}")
        optimizer.load_segments(reader.fetch)
        if not reader.has_state:  # saved before the first step: let the optimizer start afresh
            optimizer.inner.state.clear()
        optimizer.load_scalar_state(meta["scalar_state"])
        _restore_hyperparameters(optimizer, meta.get("param_groups"))
        if same_layout:
            _restore_rng(reader.rng_states(rank))
    return {"step": meta["step"], "extra": meta.get("extra"), "plan": meta["plan"],
            "world_size": meta["world_size"]}


def check_parameters(meta: dict[str, Any], model: nn.Module, strict: bool, where: str) -> None:
    """Names and shapes of the checkpoint against the model's trainable parameters."""
    saved = {n: tuple(v["shape"]) for n, v in meta["params"].items()}
    params = dict(model.named_parameters())
    shapes = {n: tuple(p.shape) for n, p in params.items()}  # DTensor: the global shape
    mismatched = [f"{n}: checkpoint {saved[n]}, model {shapes[n]}"
                  for n in sorted(saved.keys() & shapes.keys()) if saved[n] != shapes[n]]
    missing = sorted(n for n, p in params.items() if p.requires_grad and n not in saved)
    unexpected = sorted(saved.keys() - shapes.keys())
    problems = []
    if mismatched:
        problems.append("shape mismatch: " + "; ".join(mismatched))
    if missing:
        problems.append(f"missing from the checkpoint: {', '.join(missing)}")
    if unexpected and strict:
        problems.append(f"not in the model: {', '.join(unexpected)} (strict=False ignores "
                        "these)")
    if problems:
        raise CheckpointError(f"{where} does not fit this model: " + " | ".join(problems))


def _restore_hyperparameters(optimizer: BoostedOptimizer, saved: list | None) -> None:
    """Put back lr, betas, ... as saved (an LR scheduler may have changed them), as
    ``torch.optim.Optimizer.load_state_dict`` does."""
    if not saved or len(saved) != len(optimizer.param_groups):
        return
    for group, values in zip(optimizer.param_groups, saved):
        for k, v in values.items():
            if k in group:
                group[k] = tuple(v) if isinstance(group[k], tuple) else v


def _restore_rng(states: dict[str, torch.Tensor]) -> None:
    if "cpu" in states:
        torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])

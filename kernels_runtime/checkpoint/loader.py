"""``load`` / ``load_model``: restore a checkpoint into a parallelized model (and its
``BoostedOptimizer``), under the plan it was saved with or any other (another zero stage, dp
size or world size), from a training checkpoint or a model-only one.

Everything that can fail is checked before any tensor is touched, and the ranks agree on the
result: names and shapes against the model (the same verdict on every rank), then each rank's
coverage and the integrity of the files it will read. Only then is every piece the rank holds
filled (``view.copy_(saved)``) and the layout propagates it (``after_load``: masters into
parameters, all-gathers), which ends in collectives that a failing rank must not skip. RNG
states come back only when the world size and plan are the saved ones: under another layout
rank r's stream has no counterpart.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kernels_runtime.checkpoint import format as fmt
from kernels_runtime.checkpoint.agreement import agree, attempt
from kernels_runtime.checkpoint.format import CheckpointError
from kernels_runtime.checkpoint.reader import CheckpointReader
from kernels_runtime.comm import Accelerator
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.shards import Shard
from kernels_runtime.optim import PARAM, BoostedOptimizer, StatePiece
from kernels_runtime.parallel.state import parallel_state


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
    the optimizer holds must always be in it. A model-only checkpoint loads too: the optimizer
    then starts afresh from the loaded weights. Returns ``{"step", "extra", "plan",
    "world_size"}`` as saved.
    """
    step_dir = fmt.resolve_step_dir(directory, step)
    meta = fmt.read_meta(step_dir)
    check_parameters(meta, model, strict, str(step_dir))
    ctx = optimizer.ctx

    def pieces() -> list[StatePiece]:  # after the checks: views of the states it creates
        optimizer.materialize_state()
        return optimizer.pieces(saving=False)

    def after(reader: CheckpointReader) -> None:
        if not reader.has_state:  # saved before the first step, or weights only: start afresh
            optimizer.inner.state.clear()
        if meta["kind"] == "training":
            optimizer.load_scalar_state(meta["scalar_state"])
            _restore_hyperparameters(optimizer, meta.get("param_groups"))

    _fill(step_dir, meta, ctx, [p.shard for p in optimizer.pieces(saving=False)], pieces,
          optimizer.after_load, after)
    return _info(meta)


def load_model(
    directory: str | os.PathLike,
    model: nn.Module,
    step: int | None = None,
    *,
    strict: bool = True,
) -> dict[str, Any]:
    """Load the parameters of ``step`` (default: ``latest``) into ``model``, no optimizer
    needed: for evaluation and inference. A parallelized model (``parallelize_model``) reads
    only its own pieces; a plain model reads whole tensors (in one process, no process group
    needed). Collective for a parallelized model. Returns what ``load`` returns."""
    step_dir = fmt.resolve_step_dir(directory, step)
    meta = fmt.read_meta(step_dir)
    check_parameters(meta, model, strict, str(step_dir))
    state = parallel_state(model)
    if state is None:
        _load_plain(step_dir, meta, model)
        return _info(meta)
    layout = state.model_state
    assert layout is not None

    def pieces() -> list[StatePiece]:
        return layout.pieces(saving=False, optimizer=None)

    _fill(step_dir, meta, state.ctx, [p.shard for p in pieces()], pieces, layout.after_load,
          None)
    return _info(meta)


def _info(meta: dict[str, Any]) -> dict[str, Any]:
    return {"step": meta["step"], "extra": meta.get("extra"), "plan": meta["plan"],
            "world_size": meta["world_size"]}


def _fill(step_dir: Path, meta: dict[str, Any], ctx: ParallelContext, shards: list[Shard],
          pieces: Callable[[], list[StatePiece]], after_load: Callable[[], None],
          after: Callable[[CheckpointReader], None] | None) -> None:
    """Check ``shards`` are all there and undamaged (agreed by every rank), then fill the
    ``pieces()`` this rank holds, finish (``after``), and let the layout propagate them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    same_layout = meta["world_size"] == world and meta["plan"] == ctx.plan.to_string()
    with CheckpointReader(step_dir, meta) as reader:

        def verify() -> None:
            files = reader.files_for(shards)
            if same_layout:
                files.add(fmt.rank_file_name(rank))
            for file in sorted(files):
                reader.verify(file)

        agree(ctx.comm, ctx.device, attempt(verify), f"verifying {step_dir}")
        with torch.no_grad():
            for piece in pieces():
                saved = reader.fetch(piece.shard)
                for key, view in piece.values.items():
                    view.copy_(saved[key])
        if after is not None:
            after(reader)
        after_load()
        if same_layout:
            Accelerator.for_backend(dist.get_backend()).set_rng_states(reader.rng_states(rank))


def _load_plain(step_dir: Path, meta: dict[str, Any], model: nn.Module) -> None:
    with CheckpointReader(step_dir, meta) as reader, torch.no_grad():
        for name, p in model.named_parameters():
            if name in meta["params"]:
                p.copy_(reader.fetch(Shard.whole(name, tuple(p.shape)))[PARAM])


def check_parameters(meta: dict[str, Any], model: nn.Module, strict: bool, where: str) -> None:
    """Names and global shapes of the checkpoint against the model's trainable parameters."""
    saved = {n: tuple(v["shape"]) for n, v in meta["params"].items()}
    state = parallel_state(model)
    params = dict(model.named_parameters())
    shapes = {n: tuple(state.layout(n, p).shape if state is not None else p.shape)
              for n, p in params.items()}  # DTensor: the global shape
    mismatched = [f"{n}: checkpoint {saved[n]}, model {shapes[n]}"
                  for n in sorted(saved.keys() & shapes.keys()) if saved[n] != shapes[n]]
    missing = sorted(n for n, p in params.items() if p.requires_grad and n not in saved)
    elsewhere = state.elsewhere if state is not None else set()  # other pipeline stages'
    unexpected = sorted(saved.keys() - shapes.keys() - elsewhere)
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

"""The offload applier (last in ``parallelize``'s order): model-state chunks placed on device,
host or disk under ``offload=static|auto``; without an optimizer (``parallelize_model``), the
weights alone, gathered to the device unit by unit as the forward needs them.

It builds the ``ChunkGradSync`` (``chunk_sync.py``) over what the earlier appliers left (tensor-
parallel shards keep their layouts; sp ranks are data replicas), the tiers it moves payloads
between, and the placement. The spill directory is created here, before the first step, so a
directory on tmpfs or one that cannot be written is an error at ``parallelize`` time.
"""

from __future__ import annotations

import itertools
import shutil
import weakref
from pathlib import Path

import torch.distributed as dist
from torch import nn

from kernels_runtime.byte_sizes import format_bytes
from kernels_runtime.comm.accelerator import Accelerator
from kernels_runtime.memory.chunk_sync import ChunkGradSync
from kernels_runtime.memory.disk import DiskStore
from kernels_runtime.memory.expert_chunks import ExpertChunkSync
from kernels_runtime.memory.spill import SpillDir, spill_root
from kernels_runtime.memory.tiers import TierStore
from kernels_runtime.parallel.state import ParallelState


def check(state: ParallelState, model: nn.Module) -> str | None:
    """A plan that may spill needs a usable spill directory: made here, so a bad one refuses
    the plan before anything changed. Without an optimizer (``parallelize_model``: evaluation,
    inference) the chunks hold the weights alone."""
    plan = state.ctx.plan
    if plan.offload != "none" and plan.ep > 1 and state.optimizer is None:
        return (f"ep={plan.ep} with offload={plan.offload} is available for training only "
                "(parallelize with an optimizer); for evaluation or inference use "
                f"'ep={plan.ep}' without offload")
    if plan.offload != "none" and _may_spill(plan):
        try:
            _rank_folder(state.spill_dir, state.ctx.rank)
        except OSError as err:
            return f"host_mem={format_bytes(plan.host_mem)} spills to disk, but {err}"
    return None


def apply(model: nn.Module, state: ParallelState) -> nn.Module:
    plan = state.ctx.plan
    if plan.offload == "none":
        return model
    ctx = state.ctx.fold_sp()
    accelerator = Accelerator.for_backend(dist.get_backend())
    folder = _model_folder(state.spill_dir, ctx.rank) if _may_spill(plan) else None
    store = _store(accelerator, folder, ctx, plan)
    device_budget = plan.device_mem if plan.device_mem is not None \
        else accelerator.total_memory()
    settings = dict(
        blocks=state.blocks, zero_stage=plan.zero_stage, precision=plan.precision,
        placer_args={"mode": plan.offload, "device_budget": device_budget,
                     "host_budget": plan.host_mem},
        chunk_mb=chunk_mb(state.chunk_mb, device_budget, plan.host_mem),
        replaced=state.replaced_params)
    if plan.ep > 1:  # non-expert chunks over dp, expert ones over expert-dp: one placement
        sync = ExpertChunkSync(model, state.optimizer, ctx, state.layouts, store=store,
                               **settings)
    else:
        sync = ChunkGradSync(model, state.optimizer, ctx, state.layouts, store=store,
                             **settings)
    sync.spill_folder = folder
    if folder is not None:  # the model's files go with it (its rank's folder at exit)
        weakref.finalize(sync, _remove, store, folder)
    if plan.offload == "static":
        sync.place_homes({"params": plan.offload_params, "grads": plan.offload_grads,
                          "optim": plan.offload_optim}, plan.host_mem)
    else:
        sync.placer.enforce()
        store.reset_step_counters()
    state.layouts.update(sync.layouts)  # released parameters are empty: shapes live here
    state.grad_sync = sync
    state.model_state = sync
    state.applied.append("offload")
    return model


def _store(accelerator: Accelerator, folder: Path | None, ctx, plan) -> TierStore:
    store = TierStore(accelerator, disk=(lambda: DiskStore(folder)) if folder else None,
                      waiting=ctx.telemetry.waiting)
    # host-only machines re-fault every freed buffer's pages; auto's budget bounds what is kept
    store.recycle = plan.offload == "auto" and not accelerator.queues_work
    return store


def chunk_mb(default: float, *budgets: int | None) -> float:
    """Chunks small enough that a tier's budget holds several (a step works on a few at once:
    a gathered chunk, its gradient buffer, a prefetched one), at most ``default``."""
    given = [b for b in budgets if b]
    if not given:
        return default
    return min(default, min(given) / 16 / 2**20)


# One spill folder per rank process and root (a process resource, like its process groups):
# every model parallelized in the process spills into a sub-folder of its own.
_RANK_FOLDERS: dict[tuple[Path, int], SpillDir] = {}
_MODELS = itertools.count()


def _rank_folder(spill_dir: str | None, rank: int) -> SpillDir:
    root = spill_root(spill_dir)
    key = (root.absolute(), rank)
    if key not in _RANK_FOLDERS:
        _RANK_FOLDERS[key] = SpillDir(root, rank=rank)
    return _RANK_FOLDERS[key]


def _model_folder(spill_dir: str | None, rank: int) -> Path:
    folder = _rank_folder(spill_dir, rank).path / f"model-{next(_MODELS)}"
    folder.mkdir(mode=0o700)
    return folder


def _remove(store: TierStore, folder: Path) -> None:
    store.close()
    shutil.rmtree(folder, ignore_errors=True)


def _may_spill(plan) -> bool:
    """Disk is used only beyond a host budget."""
    return plan.host_mem is not None

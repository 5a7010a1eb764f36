"""``save`` / ``save_model``: every rank writes its own share of the state; rank 0 commits the
whole.

Phases, each ending in an all-rank agreement (see ``agreement``):

1. rank 0 creates ``.tmp-step-XXXXXXXX-<token>`` next to the final folder;
2. every rank writes ``rank-RRRRR.safetensors`` (the pieces its layout says it writes, and its
   RNG states) and a small JSON index of it, and fsyncs both;
3. rank 0 checks that the pieces of all ranks cover every parameter exactly once, writes
   ``meta.json`` (with each data file's size and SHA-256), renames the folder to ``step-...``,
   fsyncs the parent, replaces ``latest`` atomically and removes stale temporary folders.

All ranks must see ``directory`` (one machine, or a shared file system): rank 0 reads the other
ranks' indexes and renames the folder they wrote into.

Until the rename nothing outside the temporary folder changes, and after it the step folder is
complete, so a crash at any instant leaves the previous checkpoint and ``latest`` loadable.

A save that fails without a crash (a rank's write raised, a rank voted no) removes its
temporary folder before ``save`` raises on any rank: rank 0 deletes it once every rank has
voted (so no rank still writes into it), and a last agreement makes the others wait for that.
A half-written save is dead weight of a whole checkpoint's size, and the next successful save,
which sweeps such folders, may be far off. Only when the vote itself fails (the group is broken)
is the removal left to rank 0 alone, best effort.

To test that, ``KERNELS_RUNTIME_CHECKPOINT_CRASH=<point>[@<rank>]`` makes a rank SIGKILL itself
at ``write`` (data file written, nothing synced), ``commit`` (meta.json written, folder not
renamed) or ``latest`` (folder renamed, ``latest`` not yet updated); ``<point>-error`` (e.g.
``write-error@1``) raises a CheckpointError there instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from kernels_runtime.checkpoint import format as fmt
from kernels_runtime.checkpoint.agreement import agree, attempt, shared_token
from kernels_runtime.checkpoint.format import CheckpointError
from kernels_runtime.comm import Accelerator
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.shards import Shard, tiling_problem
from kernels_runtime.optim import BoostedOptimizer, StatePiece
from kernels_runtime.parallel.state import parallel_state

CRASH_ENV = "KERNELS_RUNTIME_CHECKPOINT_CRASH"


def save(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: BoostedOptimizer,
    step: int,
    extra: dict | None = None,
) -> Path:
    """Write a checkpoint of ``model`` and ``optimizer`` at ``step``; return its folder.

    Collective: every rank calls it. ``extra`` (JSON-serializable: data-loader position, LR
    scheduler state, ...) comes back from ``load``. Resuming under another plan or world size
    works: states are saved as boxes of the global tensors, independent of the sharding.
    """
    scalars = {"scalar_state": optimizer.scalar_state(),
               "param_groups": _hyperparameters(optimizer)}
    fmt.check_json(scalars["scalar_state"], "the optimizer's scalar_state()")
    return _save(directory, model, optimizer.ctx, lambda: optimizer.pieces(saving=True), step,
                 extra, "training", scalars)


def save_model(
    directory: str | os.PathLike, model: nn.Module, step: int = 0, extra: dict | None = None
) -> Path:
    """Write the parameters of a parallelized model (``parallelize_model`` or ``parallelize``:
    fp32 masters when training in 16 bit) without optimizer state; ``load_model`` reads it
    into any layout, ``load`` into a training run whose optimizer then starts afresh."""
    state = parallel_state(model)
    if state is None or state.model_state is None:
        raise CheckpointError(
            f"save_model needs a parallelized model (this {type(model).__name__} is not): call "
            "kernels_runtime.parallelize_model(model, plan) first (any plan, dp=1 too), or "
            "export_hf for a plain model in one process")
    return _save(directory, model, state.ctx,
                 lambda: state.model_state.pieces(saving=True, optimizer=None), step, extra,
                 "model", {})


def _save(directory: str | os.PathLike, model: nn.Module, ctx: ParallelContext,
          pieces: Any, step: int, extra: dict | None, kind: str,
          scalars: dict[str, Any]) -> Path:
    fmt.check_json(extra, "extra")  # on every rank, before anything is written
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    comm, device = ctx.comm, ctx.device
    rank, world = dist.get_rank(), dist.get_world_size()
    directory = Path(directory)
    final = directory / fmt.step_dir_name(step)
    token = shared_token(comm, device)
    tmp = directory / f"{fmt.TMP_PREFIX}{final.name}-{token}"

    def create() -> None:
        if rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()

    def write() -> None:
        _write_rank(tmp, rank, pieces(), Accelerator.for_backend(dist.get_backend()))

    def commit() -> None:
        if rank == 0:
            meta = {"format": fmt.FORMAT, "version": fmt.VERSION, "kind": kind, "step": step,
                    "plan": ctx.plan.to_string(), "world_size": world, "dp_size": ctx.dp_size,
                    "torch": torch.__version__, **scalars, "extra": extra}
            _commit(tmp, final, _meta(tmp, model, meta), token)

    for action, what in ((create, f"creating {tmp}"), (write, f"writing {tmp}"),
                         (commit, f"committing {final}")):
        error = attempt(action)
        try:
            agree(comm, device, error, what)
        except Exception as failure:
            # the vote took place when agree raised this rank's own error or the verdict
            voted = failure is error or (error is None and isinstance(failure, CheckpointError))
            _discard(tmp, rank, comm, device, voted)
            raise
    return final


def _discard(tmp: Path, rank: int, comm: Any, device: torch.device, voted: bool) -> None:
    """Remove a failed save's temporary folder (rank 0), then, when the group still works, wait
    for each other so no rank returns while the folder is still there."""
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if voted:
        with contextlib.suppress(Exception):  # the save's own error is the one to report
            agree(comm, device, None, f"removing {tmp}")


def _crash_point(point: str, rank: int) -> None:
    spec = os.environ.get(CRASH_ENV, "")
    name, _, only = spec.partition("@")
    if only and int(only) != rank:
        return
    if name == point:
        os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))
    if name == f"{point}-error":
        raise CheckpointError(f"failure injected at {point!r} by {CRASH_ENV}={spec}")


def _write_rank(tmp: Path, rank: int, pieces: list[StatePiece],
                accelerator: Accelerator) -> None:
    """This rank's data file and its index (pieces, size, SHA-256), both fsynced."""
    tensors: dict[str, torch.Tensor] = {}
    index_pieces = []
    for piece in pieces:
        shard, dtypes = piece.shard, {}
        for key, value in sorted(piece.values.items()):
            if tuple(value.shape) != tuple(shard.sizes):
                raise CheckpointError(f"a layout gave {tuple(value.shape)} values of {key!r} "
                                      f"for {shard}: a bug in its pieces")
            # a copy on the host: values are often views of live buffers shared with others
            tensors[fmt.tensor_key(shard.name, shard.key, key)] = (
                value.detach().to("cpu", copy=True).contiguous())
            dtypes[key] = str(value.dtype).removeprefix("torch.")
        index_pieces.append({"name": shard.name, "shape": list(shard.shape),
                             "offsets": list(shard.offsets), "sizes": list(shard.sizes),
                             "keys": dtypes})
    tensors.update({f"{fmt.RNG_PREFIX}{kind}": state
                    for kind, state in accelerator.rng_states().items()})
    path = tmp / fmt.rank_file_name(rank)
    save_file(tensors, str(path), metadata={"format": fmt.FORMAT, "rank": str(rank)})
    _crash_point("write", rank)
    fmt.fsync_file(path)
    size, sha = fmt.file_digest(path)
    index = {"rank": rank, "file": path.name, "bytes": size, "sha256": sha,
             "pieces": index_pieces}
    index_path = tmp / fmt.index_file_name(rank)
    fmt.write_text_durably(index_path, json.dumps(index))
    os.chmod(path, stat.S_IMODE(index_path.stat().st_mode))  # safetensors creates it 0600


def _coverage(files: dict[str, dict]) -> dict[str, tuple[int, ...]]:
    """Every tensor's global shape, after checking its saved pieces tile it exactly once."""
    shards: dict[str, list[Shard]] = {}
    for entry in files.values():
        for s in entry["pieces"]:
            shards.setdefault(s["name"], []).append(
                Shard(s["name"], tuple(s["shape"]), tuple(s["offsets"]), tuple(s["sizes"])))
    for name, found in shards.items():
        problem = tiling_problem(found[0].shape, found)
        if problem is not None:
            raise CheckpointError(f"saved pieces of {name} do not cover it exactly once: "
                                  f"{problem} (a bug in the layout's pieces)")
    return {name: found[0].shape for name, found in shards.items()}


def _hyperparameters(optimizer: BoostedOptimizer) -> list[dict[str, Any]]:
    """Numeric per-group settings (lr, betas, weight_decay, ...): LR schedulers change them."""
    out = []
    for group in optimizer.param_groups:
        kept = {}
        for k, v in group.items():
            if isinstance(v, bool) or k == "params":
                continue
            if isinstance(v, (int, float)) or (
                    isinstance(v, tuple) and all(isinstance(x, (int, float)) for x in v)):
                kept[k] = list(v) if isinstance(v, tuple) else v
        out.append(kept)
    return out


def _meta(tmp: Path, model: nn.Module, meta: dict[str, Any]) -> dict[str, Any]:
    files = {}
    for r in range(meta["world_size"]):
        index = json.loads((tmp / fmt.index_file_name(r)).read_text(encoding="utf-8"))
        files[index.pop("file")] = index
    shapes = _coverage(files)
    model_params = dict(model.named_parameters())
    params = {}
    for name, shape in sorted(shapes.items()):
        p = model_params.get(name)
        params[name] = {"shape": list(shape),
                        "dtype": str(p.dtype).removeprefix("torch.") if p is not None else None}
    return {**meta, "params": params, "files": files}


def _commit(tmp: Path, final: Path, meta: dict[str, Any], token: str) -> None:
    """meta.json, then the rename that makes the checkpoint exist, then ``latest``."""
    fmt.write_text_durably(tmp / fmt.META, json.dumps(meta, indent=1))
    for r in range(meta["world_size"]):
        (tmp / fmt.index_file_name(r)).unlink()
    fmt.fsync_dir(tmp)
    _crash_point("commit", 0)
    directory = final.parent
    if final.exists():  # saving a step again: move the old one aside, never delete it first
        aside = directory / f"{fmt.TMP_PREFIX}old-{final.name}-{token}"
        os.rename(final, aside)
        try:
            os.rename(tmp, final)
        except OSError:  # put the old one back: a failed save removes only its own folder
            os.rename(aside, final)
            raise
        fmt.fsync_dir(directory)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fmt.fsync_dir(directory)
    _crash_point("latest", 0)
    fmt.replace_text_atomically(directory / fmt.LATEST, final.name + "\n", token)
    for entry in directory.iterdir():  # saves that crashed earlier
        if entry.name.startswith(fmt.TMP_PREFIX):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

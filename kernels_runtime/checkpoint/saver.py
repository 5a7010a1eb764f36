"""``save``: every rank writes its own share of the training state; rank 0 commits the whole.

Phases, each ending in an all-rank agreement (see ``agreement``):

1. rank 0 creates ``.tmp-step-XXXXXXXX-<token>`` next to the final folder;
2. every rank writes ``rank-RRRRR.safetensors`` (its ``saved_segments`` and RNG states) and a
   small JSON index of it, and fsyncs both;
3. rank 0 checks that the segments of all ranks cover every parameter exactly once, writes
   ``meta.json`` (with each data file's size and SHA-256), renames the folder to ``step-...``,
   fsyncs the parent, replaces ``latest`` atomically and removes stale temporary folders.

All ranks must see ``directory`` (one machine, or a shared file system): rank 0 reads the other
ranks' indexes and renames the folder they wrote into.

Until the rename nothing outside the temporary folder changes, and after it the step folder is
complete, so a crash at any instant leaves the previous checkpoint and ``latest`` loadable.

To test that, ``KERNELS_RUNTIME_CHECKPOINT_CRASH=<point>[@<rank>]`` makes a rank SIGKILL itself
at ``write`` (data file written, nothing synced), ``commit`` (meta.json written, folder not
renamed) or ``latest`` (folder renamed, ``latest`` not yet updated).
"""

from __future__ import annotations

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

from kernels_runtime.api.optimizer import BoostedOptimizer
from kernels_runtime.checkpoint import format as fmt
from kernels_runtime.checkpoint.agreement import agree, attempt, shared_token
from kernels_runtime.checkpoint.format import CheckpointError

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
    works: states are saved per flat parameter range, independent of the sharding.
    """
    fmt.check_json(extra, "extra")  # on every rank, before anything is written
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    ctx = optimizer.ctx
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

    def commit() -> None:
        if rank == 0:
            meta = _meta(tmp, model, optimizer, step, extra, world)
            _commit(tmp, final, meta, token)

    agree(comm, device, attempt(create), f"creating {tmp}")
    agree(comm, device, attempt(lambda: _write_rank(tmp, rank, optimizer)), f"writing {tmp}")
    agree(comm, device, attempt(commit), f"committing {final}")
    return final


def _crash_point(point: str, rank: int) -> None:
    spec = os.environ.get(CRASH_ENV, "")
    name, _, only = spec.partition("@")
    if name == point and (not only or int(only) == rank):
        os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))


def _rng_states() -> dict[str, torch.Tensor]:
    states = {f"{fmt.RNG_PREFIX}cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states[f"{fmt.RNG_PREFIX}cuda"] = torch.cuda.get_rng_state()
    return states


def _write_rank(tmp: Path, rank: int, optimizer: BoostedOptimizer) -> None:
    """This rank's data file and its index (segments, size, SHA-256), both fsynced."""
    tensors: dict[str, torch.Tensor] = {}
    segments = []
    for seg, values in optimizer.saved_segments():
        dtypes = {}
        for key, value in sorted(values.items()):
            if value.numel() != seg.numel:
                raise CheckpointError(f"optimizer gave {value.numel()} values of {key!r} for "
                                      f"{seg}: a bug in its saved_segments")
            # a copy on the CPU: values are often views of live buffers shared with others
            tensors[fmt.tensor_key(seg.name, seg.start, key)] = (
                value.detach().reshape(-1).to("cpu", copy=True).contiguous())
            dtypes[key] = str(value.dtype).removeprefix("torch.")
        segments.append({"name": seg.name, "shape": list(seg.shape), "start": seg.start,
                         "end": seg.end, "keys": dtypes})
    tensors.update(_rng_states())
    path = tmp / fmt.rank_file_name(rank)
    save_file(tensors, str(path), metadata={"format": fmt.FORMAT, "rank": str(rank)})
    _crash_point("write", rank)
    fmt.fsync_file(path)
    size, sha = fmt.file_digest(path)
    index = {"rank": rank, "file": path.name, "bytes": size, "sha256": sha, "segments": segments}
    index_path = tmp / fmt.index_file_name(rank)
    fmt.write_text_durably(index_path, json.dumps(index))
    os.chmod(path, stat.S_IMODE(index_path.stat().st_mode))  # safetensors creates it 0600


def _coverage(files: dict[str, dict]) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape, after checking its saved ranges tile it exactly once."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for entry in files.values():
        for s in entry["segments"]:
            ranges.setdefault(s["name"], []).append((s["start"], s["end"]))
            shapes[s["name"]] = tuple(s["shape"])
    for name, spans in ranges.items():
        numel = 1
        for d in shapes[name]:
            numel *= d
        cursor = 0
        for start, end in sorted(spans):
            if start != cursor:
                what = "overlap" if start < cursor else "leave a gap"
                raise CheckpointError(f"saved segments of {name} {what} at element "
                                      f"{min(start, cursor)}: a bug in saved_segments")
            cursor = end
        if cursor != numel:
            raise CheckpointError(f"saved segments of {name} end at {cursor} of {numel} elements")
    return shapes


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


def _meta(tmp: Path, model: nn.Module, optimizer: BoostedOptimizer, step: int,
          extra: dict | None, world: int) -> dict[str, Any]:
    files = {}
    for r in range(world):
        index = json.loads((tmp / fmt.index_file_name(r)).read_text(encoding="utf-8"))
        files[index.pop("file")] = index
    shapes = _coverage(files)
    model_params = dict(model.named_parameters())
    params = {}
    for name, shape in sorted(shapes.items()):
        p = model_params.get(name)
        params[name] = {"shape": list(shape),
                        "dtype": str(p.dtype).removeprefix("torch.") if p is not None else None}
    ctx = optimizer.ctx
    meta = {"format": fmt.FORMAT, "version": fmt.VERSION, "step": step,
            "plan": ctx.plan.to_string(), "world_size": world, "dp_size": ctx.dp_size,
            "torch": torch.__version__, "scalar_state": optimizer.scalar_state(),
            "param_groups": _hyperparameters(optimizer), "extra": extra, "params": params,
            "files": files}
    fmt.check_json(meta["scalar_state"], "the optimizer's scalar_state()")
    return meta


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
        os.rename(tmp, final)
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

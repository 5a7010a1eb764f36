"""The on-disk layout of a checkpoint, and the small file helpers that keep it trustworthy.

    directory/
      latest                      "step-00000010\\n": the newest complete checkpoint
      step-00000010/
        meta.json                 what was saved and how to check it (written by rank 0)
        rank-00000.safetensors    rank 0's pieces "{name}|{offsets}|{key}" and its RNG states
        rank-00001.safetensors
      .tmp-step-00000011-9f3c...  a save in progress (or one that crashed): never read

Why this shape: a checkpoint must survive a crash at any instant, so a step folder only ever
appears complete (it is written under a temporary name and renamed), and ``latest`` is replaced
in one ``os.replace``. Data files hold plain tensors in safetensors and every other fact is JSON,
so loading never unpickles anything; ``meta.json`` records the size and SHA-256 of each data
file, so a damaged file is reported by name instead of crashing a reader or loading silently.

A piece is an n-D box of one tensor (``kernels_runtime.mesh.shards.Shard``): its offsets per
dim name it in the file, its sizes are the stored tensor's shape, and ``meta.json`` lists them
per file. Keys per piece: ``param`` (the parameter's value, the fp32 master when training in
16 bit) and the optimizer's state names. ``kind`` is "training" (with optimizer state and
``scalar_state``) or "model" (parameters only, from ``save_model``).

Version 1 (before n-D shards) stored flat row-major ranges ``{name}|{start}|{key}`` with the
key ``master``; ``reader.py`` still reads those.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

FORMAT = "kernels_runtime.checkpoint"
VERSION = 2
META = "meta.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"  # in-progress saves and replaced step folders: ignored by load
RNG_PREFIX = "__rng__|"
SEP = "|"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_REQUIRED = ("format", "version", "step", "plan", "world_size", "params", "files")
KINDS = ("training", "model")


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete, damaged, or does not fit the model it is loaded into."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def index_file_name(rank: int) -> str:
    """A rank's segment index, handed to rank 0 inside the temporary folder, then removed."""
    return f"rank-{rank:05d}.index.json"


def tensor_key(name: str, where: int | str, key: str) -> str:
    """A stored tensor's name: parameter, piece offsets ("0,64"; a flat start in version 1),
    state key."""
    return f"{name}{SEP}{where}{SEP}{key}"


def check_json(value: Any, what: str) -> str:
    """``value`` as JSON text, or a TypeError that says which value cannot be saved."""
    try:
        return json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{what} must be JSON-serializable (dicts, lists, str, numbers, bool, "
                        f"None): {err}") from None


# ---- durable writes ---------------------------------------------------------------------
def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (a no-op where directories cannot be
    opened, as on Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_durably(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def replace_text_atomically(path: Path, text: str, token: str) -> None:
    """Write ``text`` beside ``path`` and rename it over: readers see the old or the new file."""
    aside = path.with_name(f"{TMP_PREFIX}{path.name}-{token}")
    write_text_durably(aside, text)
    os.replace(aside, path)
    fsync_dir(path.parent)


def file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, SHA-256 hex) of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


# ---- finding and reading checkpoints ----------------------------------------------------
def saved_steps(directory: Path) -> list[int]:
    """Steps of the complete step folders in ``directory`` (those with a meta.json)."""
    if not directory.is_dir():
        return []
    steps = []
    for entry in directory.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and (entry / META).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def resolve_step_dir(directory: str | os.PathLike, step: int | None) -> Path:
    """The step folder to read: ``directory`` itself when it is one, the given step, or the one
    ``latest`` names (the newest complete folder when ``latest`` is absent)."""
    directory = Path(directory)
    if (directory / META).is_file() and step is None:
        return directory
    if step is not None:
        path = directory / step_dir_name(step)
        if not path.is_dir():
            raise FileNotFoundError(f"no checkpoint for step {step} in {directory} (saved steps: "
                                    f"{saved_steps(directory) or 'none'})")
        return path
    latest = directory / LATEST
    if latest.is_file():
        name = latest.read_text(encoding="utf-8").strip()
        if not _STEP_DIR.match(name):
            raise CheckpointError(f"{latest} should name a step folder, but holds {name[:40]!r}")
        path = directory / name
        if path.is_dir():
            return path
        # A save that replaced this very step crashed between its two renames: the previous
        # version is still complete under its temporary name.
        aside = sorted(directory.glob(f"{TMP_PREFIX}old-{name}-*"))
        if aside:
            return aside[0]
        raise CheckpointError(f"{latest} names {name}, which does not exist in {directory}")
    steps = saved_steps(directory)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {directory}: it has no 'latest' file and no "
                                "complete step-* folder (save one with kernels_runtime."
                                "checkpoint.save)")
    return directory / step_dir_name(steps[-1])


def read_meta(step_dir: Path) -> dict[str, Any]:
    """meta.json, checked for the fields every reader relies on."""
    path = step_dir / META
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: {step_dir} is not a complete checkpoint (a "
                              "crashed or partial copy); load another step")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not readable JSON: {err}") from None
    missing = [k for k in _REQUIRED if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise CheckpointError(f"{path} lacks the fields {missing}: damaged or not a checkpoint")
    if meta["format"] != FORMAT or meta["version"] > VERSION:
        raise CheckpointError(f"{path} has format {meta['format']!r} version {meta['version']}; "
                              f"this runtime reads {FORMAT!r} up to version {VERSION}")
    meta.setdefault("kind", "training")  # version 1 saved training checkpoints only
    if meta["kind"] not in KINDS:
        raise CheckpointError(f"{path}: kind {meta['kind']!r} is not one of {KINDS}")
    if meta["kind"] == "training" and "scalar_state" not in meta:
        raise CheckpointError(f"{path} lacks the field 'scalar_state': damaged or not a "
                              "checkpoint")
    return meta

"""``CheckpointReader``: any box of any tensor, assembled from whichever rank files hold it,
reading only what is asked for.

Resharding lives here: a checkpoint written under one plan stores each rank's pieces (n-D
boxes), and a rank of another plan asks for its own boxes, which may overlap several saved
pieces in several files. Files are opened lazily with ``safetensors.safe_open`` and sliced with
``get_slice`` along every dim, so a rank reads only the bytes of its boxes; but every file is
first checked against the size and SHA-256 in ``meta.json``, so safetensors never parses a
damaged file.

Version-1 checkpoints (flat row-major ranges, key ``master``) are read through the same
``fetch``: the ranges of a tensor are assembled whole once, then the box is cut from it.

File names in ``meta.json`` are data, not paths to trust: a copied or hand-edited checkpoint
could name ``../x`` or ``/etc/passwd``, and the reader would hash, open and parse that file. Only
names the writer makes (``rank-NNNNN.safetensors``, directly in the step folder) are accepted.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kernels_runtime.checkpoint import format as fmt
from kernels_runtime.checkpoint.format import CheckpointError
from kernels_runtime.mesh.shards import Shard
from kernels_runtime.optim import PARAM

_V1_KEYS = {"master": PARAM}  # version-1 key -> current key
# what ``fmt.rank_file_name`` writes (5 digits, more past rank 99999): a bare name, no folder
_DATA_FILE = re.compile(r"rank-\d{5,}\.safetensors")


def check_file_names(step_dir: Path, meta: dict[str, Any]) -> None:
    """CheckpointError unless every data file ``meta.json`` lists is a name the writer makes."""
    files = meta["files"]
    if not isinstance(files, dict):
        raise CheckpointError(f"{step_dir / fmt.META}: 'files' should map file names to their "
                              f"entries, got {type(files).__name__}: damaged or not a checkpoint")
    bad = [name for name in files if not (isinstance(name, str) and _DATA_FILE.fullmatch(name))]
    if bad:
        raise CheckpointError(
            f"{step_dir / fmt.META} lists data files {[str(b)[:80] for b in bad[:3]]} that the "
            "checkpoint writer never makes (it writes rank-NNNNN.safetensors inside the step "
            "folder): the metadata was altered or is not from kernels_runtime; refusing to read "
            "files it names. Load another step, or restore this one from a trusted copy")


@dataclass(frozen=True)
class Piece:
    """One saved piece: a box of a tensor (version 1: the flat range ``[start, end)``)."""

    shard: Shard | None
    file: str
    keys: dict[str, str]  # current key -> key in the file
    start: int = 0
    end: int = 0

    @property
    def where(self) -> str | int:
        return self.shard.key if self.shard is not None else self.start


class _Values(dict):
    """Fetched values; a state key the checkpoint lacks is zeros when the checkpoint has no
    optimizer state at all (saved before the first step, or a model checkpoint), else a clear
    error."""

    def __init__(self, shard: Shard, has_state: bool) -> None:
        super().__init__()
        self.shard, self.has_state = shard, has_state

    def __missing__(self, key: str) -> torch.Tensor:
        if not self.has_state:
            return torch.zeros(self.shard.sizes, dtype=torch.float32)
        raise CheckpointError(f"the checkpoint has no optimizer state {key!r} for "
                              f"{self.shard.name} (it has {sorted(self)}): it was saved with "
                              "another optimizer class")


def _pieces_of(meta: dict[str, Any]) -> dict[str, list[Piece]]:
    out: dict[str, list[Piece]] = {}
    legacy = meta["version"] < 2
    for file, entry in meta["files"].items():
        for s in entry["segments" if legacy else "pieces"]:
            if legacy:
                keys = {_V1_KEYS.get(k, k): k for k in s["keys"]}
                piece = Piece(None, file, keys, s["start"], s["end"])
            else:
                shape = tuple(meta["params"][s["name"]]["shape"])
                shard = Shard(s["name"], shape, tuple(s["offsets"]), tuple(s["sizes"]))
                piece = Piece(shard, file, {k: k for k in s["keys"]})
            out.setdefault(s["name"], []).append(piece)
    return out


class CheckpointReader(contextlib.AbstractContextManager):
    def __init__(self, step_dir: Path, meta: dict[str, Any]) -> None:
        check_file_names(step_dir, meta)
        self.step_dir, self.meta = step_dir, meta
        self.legacy = meta["version"] < 2
        self.pieces = _pieces_of(meta)
        self.has_state = any(set(p.keys) - {PARAM} for ps in self.pieces.values() for p in ps)
        self._verified: set[str] = set()
        self._handles: dict[str, Any] = {}
        self._whole: tuple[str, str, torch.Tensor] | None = None  # version 1: last assembled
        self._stack = contextlib.ExitStack()

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._handles.clear()
        self._whole = None

    # ---- planning -----------------------------------------------------------------------
    def overlapping(self, shard: Shard) -> list[tuple[Piece, Shard | None]]:
        """The saved pieces that make up ``shard`` with their common box (version 1: None);
        CheckpointError if they leave part of it uncovered."""
        pieces = self.pieces.get(shard.name, [])
        if self.legacy:
            covered = sum(p.end - p.start for p in pieces)
            if covered != math.prod(shard.shape):
                raise CheckpointError(f"the checkpoint in {self.step_dir} holds {covered} of the "
                                      f"{math.prod(shard.shape)} elements of {shard.name}")
            return [(p, None) for p in pieces]
        out = [(p, common) for p in pieces if (common := p.shard.intersect(shard)) is not None]
        held = sum(common.numel for _, common in out)
        if shard.numel and held != shard.numel:
            raise CheckpointError(f"the checkpoint in {self.step_dir} holds {held} of the "
                                  f"{shard.numel} elements of {shard.name} at offsets "
                                  f"{shard.offsets} sizes {shard.sizes}")
        return out

    def files_for(self, shards: list[Shard]) -> set[str]:
        return {p.file for shard in shards if shard.numel for p, _ in self.overlapping(shard)}

    # ---- reading ------------------------------------------------------------------------
    def verify(self, file: str) -> None:
        """Check a data file's size and SHA-256 against meta.json (once per file)."""
        if file in self._verified:
            return
        entry = self.meta["files"].get(file)
        path = self.step_dir / file
        if entry is None:
            raise CheckpointError(f"{path} is not listed in meta.json")
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
        size, sha = fmt.file_digest(path)
        if size != entry["bytes"]:
            raise CheckpointError(f"{path} has {size} bytes but meta.json recorded "
                                  f"{entry['bytes']}: the file is truncated or damaged")
        if sha != entry["sha256"]:
            raise CheckpointError(f"{path} fails its SHA-256 check (meta.json: "
                                  f"{entry['sha256'][:16]}..., file: {sha[:16]}...): its "
                                  "contents were altered or corrupted")
        self._verified.add(file)

    def _open(self, file: str) -> Any:
        if file not in self._handles:
            self.verify(file)
            path = self.step_dir / file
            handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            listed = {fmt.tensor_key(name, p.where, k) for name, ps in self.pieces.items()
                      for p in ps if p.file == file for k in p.keys.values()}
            absent = listed - set(handle.keys())
            if absent:
                raise CheckpointError(f"{path} lacks tensors listed in meta.json, e.g. "
                                      f"{sorted(absent)[:3]}")
            self._handles[file] = handle
        return self._handles[file]

    def fetch(self, shard: Shard) -> dict[str, torch.Tensor]:
        """``{"param": ..., <state key>: ...}`` for ``shard``, each a tensor of its sizes."""
        out = _Values(shard, self.has_state)
        if shard.numel == 0:
            return out
        found = self.overlapping(shard)
        keys = set(found[0][0].keys)
        for piece, _ in found:
            if set(piece.keys) != keys:
                raise CheckpointError(f"{shard.name}: saved pieces hold different state keys "
                                      f"({sorted(keys)} vs {sorted(piece.keys)})")
        for key in sorted(keys):
            if self.legacy:
                whole = self._assembled(shard.name, key, found)
                out[key] = whole[tuple(slice(o, o + s) for o, s in
                                       zip(shard.offsets, shard.sizes))].clone()
                continue
            for piece, common in found:
                stored = self._open(piece.file).get_slice(
                    fmt.tensor_key(shard.name, piece.where, piece.keys[key]))
                chunk = stored[piece.shard.slices_of(common)] if shard.shape else stored[()]
                if key not in out:
                    out[key] = torch.empty(shard.sizes, dtype=chunk.dtype)
                out[key][shard.slices_of(common)] = chunk
        return out

    def _assembled(self, name: str, key: str,
                   found: list[tuple[Piece, Shard | None]]) -> torch.Tensor:
        """Version 1: the whole tensor from its flat ranges (kept while the same is asked)."""
        if self._whole is not None and self._whole[:2] == (name, key):
            return self._whole[2]
        shape = tuple(self.meta["params"][name]["shape"])
        flat = None
        for piece, _ in found:
            chunk = self._open(piece.file).get_tensor(
                fmt.tensor_key(name, piece.start, piece.keys[key]))
            if flat is None:
                flat = torch.empty(math.prod(shape), dtype=chunk.dtype)
            flat[piece.start:piece.end] = chunk
        assert flat is not None
        self._whole = (name, key, flat.view(shape))
        return self._whole[2]

    def full(self, name: str) -> torch.Tensor:
        """The whole ``param`` value of tensor ``name``, in its global shape."""
        shape = tuple(self.meta["params"][name]["shape"])
        return self.fetch(Shard.whole(name, shape))[PARAM]

    def rng_states(self, rank: int) -> dict[str, torch.Tensor]:
        """The RNG states rank ``rank`` saved, by device kind."""
        handle = self._open(fmt.rank_file_name(rank))
        names = [k for k in handle.keys() if k.startswith(fmt.RNG_PREFIX)]  # noqa: SIM118
        return {k.removeprefix(fmt.RNG_PREFIX): handle.get_tensor(k) for k in names}

"""``CheckpointReader``: any flat range of any parameter, assembled from whichever rank files
hold it, reading only what is asked for.

Resharding lives here: a checkpoint written under one plan stores each rank's flat ranges
(``Segment``), and a rank of another plan asks for its own ranges, which may span several saved
ones from several files. Files are opened lazily with ``safetensors.safe_open`` and sliced with
``get_slice``, so a rank reads only the bytes of its ranges; but every file is first checked
against the size and SHA-256 in ``meta.json``, so safetensors never parses a damaged file.
"""

from __future__ import annotations

import bisect
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kernels_runtime.api.optimizer import Segment, SegmentValues
from kernels_runtime.checkpoint import format as fmt
from kernels_runtime.checkpoint.format import CheckpointError


@dataclass(frozen=True)
class Piece:
    """One saved segment: elements [start, end) of a parameter, in ``file``."""

    start: int
    end: int
    file: str
    keys: tuple[str, ...]


class _Values(dict):
    """Fetched values; a state key the checkpoint lacks is zeros when the checkpoint has no
    optimizer state at all (saved before the first step), else a clear error."""

    def __init__(self, seg: Segment, has_state: bool) -> None:
        super().__init__()
        self.seg, self.has_state = seg, has_state

    def __missing__(self, key: str) -> torch.Tensor:
        if not self.has_state:
            return torch.zeros(self.seg.numel, dtype=torch.float32)
        raise CheckpointError(f"the checkpoint has no optimizer state {key!r} for "
                              f"{self.seg.name} (it has {sorted(self)}): it was saved with "
                              "another optimizer class")


class CheckpointReader(contextlib.AbstractContextManager):
    def __init__(self, step_dir: Path, meta: dict[str, Any]) -> None:
        self.step_dir, self.meta = step_dir, meta
        self.pieces: dict[str, list[Piece]] = {}
        for file, entry in meta["files"].items():
            for s in entry["segments"]:
                piece = Piece(s["start"], s["end"], file, tuple(s["keys"]))
                self.pieces.setdefault(s["name"], []).append(piece)
        for pieces in self.pieces.values():
            pieces.sort(key=lambda p: p.start)
        self.has_state = any(len(p.keys) > 1 for ps in self.pieces.values() for p in ps)
        self._verified: set[str] = set()
        self._handles: dict[str, Any] = {}
        self._stack = contextlib.ExitStack()

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._handles.clear()

    # ---- planning -----------------------------------------------------------------------
    def overlapping(self, seg: Segment) -> list[Piece]:
        """The saved pieces that make up ``seg``; CheckpointError if they leave a gap."""
        pieces = self.pieces.get(seg.name, [])
        i = max(0, bisect.bisect_right([p.start for p in pieces], seg.start) - 1)
        out, cursor = [], seg.start
        for p in pieces[i:]:
            if p.start >= seg.end:
                break
            if p.end <= cursor:
                continue
            if p.start > cursor:
                break
            out.append(p)
            cursor = p.end
        if cursor < seg.end:
            raise CheckpointError(f"the checkpoint in {self.step_dir} does not hold elements "
                                  f"[{cursor}, {seg.end}) of {seg.name}")
        return out

    def files_for(self, segments: list[Segment]) -> set[str]:
        return {p.file for seg in segments if seg.numel for p in self.overlapping(seg)}

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
            listed = {fmt.tensor_key(name, p.start, k) for name, ps in self.pieces.items()
                      for p in ps if p.file == file for k in p.keys}
            absent = listed - set(handle.keys())
            if absent:
                raise CheckpointError(f"{path} lacks tensors listed in meta.json, e.g. "
                                      f"{sorted(absent)[:3]}")
            self._handles[file] = handle
        return self._handles[file]

    def fetch(self, seg: Segment) -> SegmentValues:
        """``{"master": ..., <state key>: ...}`` for ``seg``, each a flat tensor of its size."""
        out = _Values(seg, self.has_state)
        if seg.numel == 0:
            return out
        pieces = self.overlapping(seg)
        keys = set(pieces[0].keys)
        for p in pieces:
            if set(p.keys) != keys:
                raise CheckpointError(f"{seg.name}: saved pieces hold different state keys "
                                      f"({sorted(keys)} vs {sorted(p.keys)})")
            lo, hi = max(seg.start, p.start), min(seg.end, p.end)
            handle = self._open(p.file)
            for key in keys:
                chunk = handle.get_slice(fmt.tensor_key(seg.name, p.start, key))
                chunk = chunk[lo - p.start:hi - p.start]
                if key not in out:
                    out[key] = torch.empty(seg.numel, dtype=chunk.dtype)
                out[key][lo - seg.start:hi - seg.start] = chunk
        return out

    def full(self, name: str) -> torch.Tensor:
        """The whole fp32 master of parameter ``name``, in its shape."""
        shape = tuple(self.meta["params"][name]["shape"])
        numel = 1
        for d in shape:
            numel *= d
        return self.fetch(Segment(name, shape, 0, numel))["master"].reshape(shape)

    def rng_states(self, rank: int) -> dict[str, torch.Tensor]:
        """The RNG states rank ``rank`` saved, by device kind ("cpu", "cuda")."""
        handle = self._open(fmt.rank_file_name(rank))
        names = [k for k in handle.keys() if k.startswith(fmt.RNG_PREFIX)]  # noqa: SIM118
        return {k.removeprefix(fmt.RNG_PREFIX): handle.get_tensor(k) for k in names}

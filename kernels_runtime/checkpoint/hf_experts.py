"""A ``save_pretrained`` folder's per-expert tensors read as the fused ones the model holds.

Why: transformers 5 holds a Mixtral's or Qwen-MoE's experts fused, ``mlp.experts.gate_up_proj``
(E, 2I, h) and ``mlp.experts.down_proj`` (E, h, I), but ``save_pretrained`` writes them back in
the families' published layout, one 2-D tensor per expert and projection (Mixtral:
``block_sparse_moe.experts.{e}.w1/w2/w3.weight``, w1 the gate, w3 the up projection, w2 down;
Qwen-MoE: ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``), and the Mixtral router as
``block_sparse_moe.gate.weight``. ``from_pretrained`` converts them while loading (its
``conversion_mapping``); ``load_pretrained`` reads boxes instead, so it needs the same mapping
per box: a box of a fused tensor (experts [e0, e0+n), rows, columns) is read expert by expert,
its rows from the part (gate, then up) each lies in. Only this rank's box is read, as for any
other tensor: under ep a rank reads its experts' tensors alone.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

Reader = Callable[[Path, str, tuple[int, ...], tuple[int, ...], torch.Tensor], None]

# fused name -> per-expert part templates ({pre}: the block's path, {e}: the expert), one tuple
# per family, the parts concatenated along dim 1 of the fused tensor
_FUSED = {
    re.compile(r"^(?P<pre>.+)\.mlp\.experts\.gate_up_proj$"): (
        ("{pre}.block_sparse_moe.experts.{e}.w1.weight",
         "{pre}.block_sparse_moe.experts.{e}.w3.weight"),
        ("{pre}.mlp.experts.{e}.gate_proj.weight", "{pre}.mlp.experts.{e}.up_proj.weight")),
    re.compile(r"^(?P<pre>.+)\.mlp\.experts\.down_proj$"): (
        ("{pre}.block_sparse_moe.experts.{e}.w2.weight",),
        ("{pre}.mlp.experts.{e}.down_proj.weight",)),
}
_RENAMED = {re.compile(r"^(?P<pre>.+)\.mlp\.gate\.weight$"): "{pre}.block_sparse_moe.gate.weight"}


@dataclass(frozen=True)
class FusedExperts:
    """One fused expert tensor the files hold as ``parts`` per expert (templates with ``{e}``),
    stacked along dim 1."""

    parts: tuple[str, ...]
    experts: int
    files: dict[str, Path]

    def _shape(self, name: str) -> tuple[int, ...]:
        with safe_open(str(self.files[name]), "pt") as f:
            return tuple(f.get_slice(name).get_shape())

    @property
    def part_rows(self) -> list[int]:
        return [self._shape(p.format(e=0))[0] for p in self.parts]

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, rows of all parts, columns), as the model's fused tensor."""
        return (self.experts, sum(self.part_rows), self._shape(self.parts[0].format(e=0))[1])

    def read(self, offsets: tuple[int, ...], sizes: tuple[int, ...], out: torch.Tensor,
             read: Reader) -> None:
        """``out[...] = fused[box]`` (``out``: (n, rows, cols)), each expert's rows from the
        parts they lie in, through ``read`` (``pretrained._read``: one part's 2-D box)."""
        rows = self.part_rows
        lo, hi = offsets[1], offsets[1] + sizes[1]
        for i in range(sizes[0]):
            start = 0
            for part, count in zip(self.parts, rows):
                a, b = max(lo, start), min(hi, start + count)
                if a < b:
                    name = part.format(e=offsets[0] + i)
                    read(self.files[name], name, (a - start, offsets[2]), (b - a, sizes[2]),
                         out[i, a - lo:b - lo])  # (b - a, cols) of this expert's box
                start += count


def per_expert_sources(names: Iterable[str], files: dict[str, Path]
                       ) -> tuple[dict[str, FusedExperts], dict[str, str]]:
    """For the model's ``names`` the files lack: ({fused name: its per-expert parts}, {model
    name: the name the files hold it under}); names no family explains are left out (the
    caller's check then says they are missing)."""
    fused: dict[str, FusedExperts] = {}
    renamed: dict[str, str] = {}
    for name in names:
        if name in files:
            continue
        for pattern, families in _FUSED.items():
            match = pattern.match(name)
            for parts in families if match else ():
                parts = tuple(p.replace("{pre}", match["pre"]) for p in parts)
                if all(p.format(e=0) in files for p in parts):
                    count = 0
                    while all(p.format(e=count) in files for p in parts):
                        count += 1
                    fused[name] = FusedExperts(parts, count, files)
                    break
        for pattern, template in _RENAMED.items():
            match = pattern.match(name)
            if match and template.format(pre=match["pre"]) in files:
                renamed[name] = template.format(pre=match["pre"])
    return fused, renamed

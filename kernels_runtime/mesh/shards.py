"""n-D shards: which box of a global tensor a rank holds.

Every parallel strategy splits a parameter (and its gradient, fp32 master and optimizer
states) a different way: tensor parallelism takes rows or columns (or several blocks, for a
fused QKV), ZeRO takes a flat range of a tp shard, a pipeline keeps whole tensors per stage.
Checkpoints must be able to write any such layout and read it back into any other, so model
state is described in one vocabulary: a ``Shard`` is a box of the global tensor (offsets and
sizes per dim). A flat row-major range, ZeRO's unit, is a few boxes (``flat_range_boxes``), each
contiguous in memory; a box held by several replicas is written by one of them, or split
among them (``split_box``) so replicas write in parallel.

No torch here: shards are plain integers, so layouts are checked without processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclass(frozen=True)
class Shard:
    """Elements ``[offsets[d], offsets[d] + sizes[d])`` along every dim d of tensor ``name``,
    whose global shape is ``shape``."""

    name: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.shape) == len(self.offsets) == len(self.sizes):
            raise ValueError(f"shard of {self.name}: shape {self.shape}, offsets "
                             f"{self.offsets} and sizes {self.sizes} differ in length")
        for d, (n, o, s) in enumerate(zip(self.shape, self.offsets, self.sizes)):
            if o < 0 or s < 0 or o + s > n:
                raise ValueError(f"shard of {self.name}: dim {d} [{o}, {o + s}) is outside "
                                 f"its size {n}")

    @classmethod
    def whole(cls, name: str, shape: tuple[int, ...]) -> Shard:
        return cls(name, tuple(shape), (0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def key(self) -> str:
        """The offsets as text, naming the shard inside a checkpoint file."""
        return ",".join(map(str, self.offsets))

    def intersect(self, other: Shard) -> Shard | None:
        """The common box (same tensor), or None when they do not overlap."""
        if other.name != self.name or other.shape != self.shape:
            return None
        offsets, sizes = [], []
        for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo, hi = max(a, b), min(a + n, b + m)
            if lo >= hi:
                return None
            offsets.append(lo)
            sizes.append(hi - lo)
        return Shard(self.name, self.shape, tuple(offsets), tuple(sizes))

    def slices_of(self, inner: Shard) -> tuple[slice, ...]:
        """Where ``inner`` (a box inside this one) lies in this shard's own local tensor."""
        return tuple(slice(i - o, i - o + s)
                     for o, i, s in zip(self.offsets, inner.offsets, inner.sizes))


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[Box, int]]:
    """The elements ``[start, end)`` of a row-major tensor of ``shape`` as boxes, each with its
    first element's flat index; each box is contiguous in row-major order, in increasing order.
    At most 2 * (dims - 1) + 1 boxes."""
    if start >= end:
        return []
    if not shape:
        return [(((), ()), 0)]
    if len(shape) == 1:
        return [(((start,), (end - start,)), start)]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(end, inner)

    def row_part(row: int, lo: int, hi: int) -> list[tuple[Box, int]]:
        return [(((row, *o), (1, *s)), row * inner + f)
                for (o, s), f in flat_range_boxes(shape[1:], lo, hi)]

    if r0 == r1:
        return row_part(r0, c0, c1)
    out = []
    if c0:
        out += row_part(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append((((r0, *[0] * (len(shape) - 1)), (r1 - r0, *shape[1:])), r0 * inner))
    if c1:
        out += row_part(r1, 0, c1)
    return out


def split_box(offsets: tuple[int, ...], sizes: tuple[int, ...], parts: int,
              index: int) -> Box | None:
    """Part ``index`` of ``parts`` near-equal pieces of a box along its first dim (None when
    that part is empty, e.g. more replicas than rows); a 0-dim box goes whole to part 0."""
    if not sizes:
        return (offsets, sizes) if index == 0 else None
    rows = sizes[0]
    lo, hi = rows * index // parts, rows * (index + 1) // parts
    if lo >= hi:
        return None
    return (offsets[0] + lo, *offsets[1:]), (hi - lo, *sizes[1:])


def tiling_problem(shape: tuple[int, ...], shards: list[Shard]) -> str | None:
    """Why ``shards`` do not cover a tensor of ``shape`` exactly once (None when they do)."""
    foreign = [s.shape for s in shards if tuple(s.shape) != tuple(shape)]
    if foreign:
        return f"boxes of shape {foreign[0]} in a tensor of shape {tuple(shape)}"
    total = sum(s.numel for s in shards)
    nonempty = [s for s in shards if s.numel]
    for i, a in enumerate(nonempty):
        for b in nonempty[i + 1:]:
            if a.intersect(b) is not None:
                return f"boxes at {a.offsets} and {b.offsets} overlap"
    if total != math.prod(shape):
        return f"boxes hold {total} of its {math.prod(shape)} elements"
    return None


def intersect_boxes(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of one tensor, or None."""
    offsets, sizes = [], []
    for ao, an, bo, bn in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if lo >= hi:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)


Block = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # local offsets, global, sizes


@dataclass(frozen=True)
class ParamLayout:
    """How one parameter is laid out over the mesh: which boxes of the global tensor this
    rank's local tensor holds, and the axes along which ranks hold different parts (or
    different parameters: "pp"). Along every other axis the local tensor is replicated.

    A row- or column-parallel weight is one box; a fused QKV split by heads is three (this
    rank's heads of q, of k and of v sit side by side locally but apart globally), so a layout
    is a list of blocks, each mapping a box of the local tensor onto an equal box of the global
    one. Tensor and pipeline parallelism set layouts; data parallelism shards the local tensor
    on top (ZeRO over dp), and checkpoints place every piece through them.
    """

    shape: tuple[int, ...]  # global
    blocks: tuple[Block, ...]
    sharded: frozenset[str] = frozenset()
    # (this rank's index, count) among the ranks of its sharded axes holding the same boxes:
    # a 2D grid's norm chunk is held by every row of its column, a 2.5D weight block by every
    # depth. A gradient norm counts index 0 only; checkpoint writers split the boxes among them.
    replica: tuple[int, int] = (0, 1)

    @classmethod
    def replicated(cls, local_shape: tuple[int, ...]) -> ParamLayout:
        zero = (0,) * len(local_shape)
        return cls(tuple(local_shape), ((zero, zero, tuple(local_shape)),))

    @classmethod
    def box(cls, shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...],
            sharded: frozenset[str] = frozenset()) -> ParamLayout:
        """The local tensor is the one box ``offsets``/``sizes`` of the global ``shape``."""
        return cls(tuple(shape), (((0,) * len(shape), tuple(offsets), tuple(sizes)),), sharded)

    def shards(self, name: str, box: Box) -> list[tuple[Shard, tuple[slice, ...]]]:
        """The global ``Shard``s of a box of the local tensor, each with the slices where it
        lies inside that box (one per layout block it overlaps)."""
        out = []
        for local, global_, sizes in self.blocks:
            common = intersect_boxes(box, (local, sizes))
            if common is None:
                continue
            at, extent = common
            where = tuple(slice(c - b, c - b + n) for c, b, n in zip(at, box[0], extent))
            offsets = tuple(g + c - lo for g, c, lo in zip(global_, at, local))
            out.append((Shard(name, self.shape, offsets, extent), where))
        return out

    @property
    def signature(self) -> tuple:
        """What parameters sharing one flat bucket must have in common: their sharding axes
        and replica place (a gradient norm and a checkpoint writer are decided per bucket)."""
        return (*sorted(self.sharded), self.replica)

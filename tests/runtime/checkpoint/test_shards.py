"""n-D shards: the vocabulary every layout and every checkpoint shares.

What is protected: a flat row-major range is exactly covered by its boxes, each contiguous; a
replicated box split among replicas covers it once; a tiling with a gap or an overlap is named.
Then, on 4 real ranks, a state with a tensor split by rows over one axis and by columns over
another, a tensor split over one axis and replicated over the other, and a tensor replicated
everywhere is saved under each of three layouts and loaded into each of the three: every load
gives back exactly the global values (9 round trips and reshards, two state keys each). An 8-rank
layout (dp x pp x tp) adds a genuine third axis: the weight split by rows over dp and by
columns over tp is replicated over pp; it reshards to and from the 4-rank layouts exactly.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from kernels_runtime.mesh.shards import Shard, flat_range_boxes, split_box, tiling_problem

from helpers.distributed import context


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (2, 1, 3, 2), ()])
def test_flat_ranges_become_contiguous_boxes(shape):
    numel = math.prod(shape)
    for start, end in itertools.combinations(range(numel + 1), 2):
        boxes = flat_range_boxes(shape, start, end)
        assert len(boxes) <= max(1, 2 * (len(shape) - 1) + 1)
        covered = []
        for (offsets, sizes), flat in boxes:
            index = torch.arange(numel).reshape(shape)
            values = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
            assert values.tolist() == list(range(flat, flat + values.numel()))  # contiguous
            covered += values.tolist()
        assert covered == list(range(start, end))


def test_split_box_gives_each_replica_a_part():
    parts = [split_box((2, 0), (5, 3), 3, i) for i in range(3)]
    assert parts == [((2, 0), (1, 3)), ((3, 0), (2, 3)), ((5, 0), (2, 3))]
    # more replicas than rows: one of them writes nothing
    assert split_box((0,), (1,), 2, 0) is None and split_box((0,), (1,), 2, 1) == ((0,), (1,))
    assert split_box((), (), 2, 0) == ((), ()) and split_box((), (), 2, 1) is None


def test_tiling_problems_are_named():
    def shard(offsets, sizes):
        return Shard("w", (4, 4), offsets, sizes)

    whole = [shard((0, 0), (2, 4)), shard((2, 0), (2, 4))]
    assert tiling_problem((4, 4), whole) is None
    assert "overlap" in tiling_problem((4, 4), [*whole, shard((1, 1), (1, 1))])
    assert "12 of its 16" in tiling_problem((4, 4), whole[:1] + [shard((2, 0), (1, 4))])
    with pytest.raises(ValueError, match="outside its size"):
        shard((3, 0), (2, 4))


# ---- three layouts of one state on 4 ranks ------------------------------------------------
SHAPES = {"weight": (6, 8), "column": (5, 4), "bias": (7,)}
KEYS = ("param", "exp_avg")


def _global(name: str, key: str) -> torch.Tensor:
    numel = math.prod(SHAPES[name])
    base = torch.arange(numel, dtype=torch.float32).reshape(SHAPES[name])
    return base + (1000.0 if key == "exp_avg" else 0.0) + 100.0 * list(SHAPES).index(name)


def _rows(box, parts, i):
    return split_box(*box, parts, i)


def _cols(box, parts, i):
    (r, c), (nr, nc) = box
    lo, hi = nc * i // parts, nc * (i + 1) // parts
    return (r, c + lo), (nr, hi - lo)


def _whole(name):
    return (0,) * len(SHAPES[name]), SHAPES[name]


def _layout(name: str, layout: int, dp: int, tp: int, pp: int = 0) -> tuple:
    """(held box, (replica index, replicas)) of tensor ``name`` on the rank at (dp, pp, tp)."""
    whole = _whole(name)
    if layout == 3:  # plan dp=2 pp=2 tp=2 on 8 ranks
        if name == "weight":  # rows over dp, columns over tp, replicated over pp
            return _cols(_rows(whole, 2, dp), 2, tp), (pp, 2)
        if name == "column":  # columns over pp, replicated over dp and tp
            return _cols(whole, 2, pp), (dp * 2 + tp, 4)
        return _rows(whole, 2, tp), (dp * 2 + pp, 4)  # rows over tp, replicated over dp, pp
    if layout == 0:  # plan dp=2 tp=2
        if name == "weight":  # rows over dp, columns over tp
            return _cols(_rows(whole, 2, dp), 2, tp), (0, 1)
        if name == "column":  # columns over tp, replicated over dp
            return _cols(whole, 2, tp), (dp, 2)
        return whole, (dp * 2 + tp, 4)  # replicated over both
    if layout == 1:  # plan dp=4: rows over dp (5 rows over 4 ranks: one gets 2)
        if name == "bias":
            return whole, (dp, 4)
        return _rows(whole, 4, dp), (0, 1)
    # layout 2, plan dp=2 tp=2 with the roles swapped: columns over dp, rows over tp
    if name == "weight":
        return _rows(_cols(whole, 2, dp), 2, tp), (0, 1)
    if name == "column":
        return _rows(whole, 2, dp), (tp, 2)  # rows over dp, replicated over tp
    return _rows(whole, 4, dp * 2 + tp), (0, 1)  # split over both, nothing replicated


PLANS = ("dp=2 tp=2", "dp=4", "dp=2 tp=2", "dp=2 pp=2 tp=2 microbatches=2")


class _GridState:
    """A ``ModelState`` holding this rank's boxes of the three tensors, with two keys."""

    def __init__(self, layout: int, ctx) -> None:
        self.boxes = {}
        for name in SHAPES:
            box, replica = _layout(name, layout, ctx.coord("dp"), ctx.coord("tp"),
                                   ctx.coord("pp"))
            self.boxes[name] = (box, replica)
        self.values = {(n, k): torch.zeros(b[1]) for n, (b, _) in self.boxes.items()
                       for k in KEYS}

    def fill_from_global(self) -> None:
        for (name, key), t in self.values.items():
            (offsets, sizes), _ = self.boxes[name]
            t.copy_(_global(name, key)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))])

    def pieces(self, saving, optimizer):
        from kernels_runtime.optim import StatePiece

        out = []
        for name, ((offsets, sizes), (index, count)) in self.boxes.items():
            part = split_box(offsets, sizes, count, index) if saving and count > 1 \
                else (offsets, sizes)
            if part is None:
                continue
            local = tuple(slice(o - b, o - b + s) for o, b, s in zip(part[0], offsets, part[1]))
            values = {k: self.values[(name, k)][local] for k in KEYS}
            out.append(StatePiece(Shard(name, SHAPES[name], part[0], part[1]), values))
        return out

    def after_load(self) -> None:
        pass


def _model(layout: int, ctx) -> nn.Module:
    """A module whose ``parallel_state`` is the grid layout (what parallelize would record)."""
    from kernels_runtime.mesh.shards import ParamLayout
    from kernels_runtime.parallel.state import ParallelState
    from kernels_runtime.policies import GenericPolicy

    model, state = nn.Module(), _GridState(layout, ctx)
    for name in state.boxes:
        model.register_parameter(name, nn.Parameter(state.values[(name, "param")]))
    layouts = {n: ParamLayout.box(SHAPES[n], b[0], b[1]) for n, (b, _) in state.boxes.items()}
    model.__dict__["parallel_state"] = ParallelState(ctx, GenericPolicy(), layouts=layouts,
                                                     model_state=state)
    return model, state


def _save(rank: int, world: int, root: str, layouts: list[int]) -> None:
    from kernels_runtime.checkpoint import save_model

    for layout in layouts:
        model, state = _model(layout, context(PLANS[layout]))
        state.fill_from_global()
        save_model(f"{root}/layout{layout}", model, step=1)


def _load(rank: int, world: int, root: str, saved: list[int], layouts: list[int]) -> dict:
    from kernels_runtime.checkpoint import load_model

    out = {}
    for source in saved:
        for layout in layouts:
            model, state = _model(layout, context(PLANS[layout]))
            load_model(f"{root}/layout{source}", model)
            wrong = []
            for (name, key), value in state.values.items():
                (offsets, sizes), _ = state.boxes[name]
                want = _global(name, key)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                if not torch.equal(value, want):
                    wrong.append(f"{name}/{key}")
            out[(source, layout)] = wrong
    return out


def _check(results: list[dict], pairs: int) -> None:
    for rank, result in enumerate(results):
        assert len(result) == pairs
        for (saved, loaded), wrong in result.items():
            assert not wrong, f"rank {rank}: saved under layout {saved}, loaded under " \
                              f"{loaded}: {wrong} differ"


@pytest.mark.slow
def test_three_layouts_round_trip_and_reshard_exactly(ranks, tmp_path):
    ranks(4).run(_save, str(tmp_path), [0, 1, 2])
    _check(ranks(4).run(_load, str(tmp_path), [0, 1, 2], [0, 1, 2]), 9)


@pytest.mark.full
def test_a_third_replicated_axis_reshards_to_and_from_four_ranks(ranks, tmp_path):
    ranks(8).run(_save, str(tmp_path), [3])
    ranks(4).run(_save, str(tmp_path), [0, 1])
    _check(ranks(4).run(_load, str(tmp_path), [3], [0, 1, 2]), 3)
    _check(ranks(8).run(_load, str(tmp_path), [0, 1, 3], [3]), 3)

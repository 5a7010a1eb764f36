"""The counts behind ``python -m bench tensor_parallel_grid``, on its quick model (HF LLaMA, 2
layers, h=64, 8 heads) under tp=4 tp_mode=2d on 4 real gloo ranks; no timing.

What is protected:
- per transformer layer, every rank's instrumented collectives are exactly the grid formula's,
  op by op and group by group, in both passes: each of the seven linears its own SUMMA (q
  broadcasts of X blocks along tp_row and of W blocks along tp_col per pass, one
  reduce-scatter of the dX and of the dW partials in backward), the two RMSNorm2D's per-token
  sums along the row and their weight gradients over the column; nothing on the whole tp group;
- outside the layers, the embedding, final norm, LM head and loss move the formula's bytes,
  with the mirror swap only off the grid's diagonal;
- local parameter bytes per rank are within 10% of 1/q^2 of the unsplit model's (measured here,
  and equal to its formula) and equal the exact count (norms' chunk j on every row, the
  vocabulary padded to q chunks);
- bytes saved for backward per layer equal the grid formula and are within 10% of 1/q^2 of the
  unsplit model's;
- (no ranks) the grid sends fewer bytes per layer than 1D at the same tp exactly past the
  break-even b*s section 2 prints, and a 2x2 grid never does.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.tensor_parallel_grid.formulas import (
    activation_bytes_grid,
    activation_bytes_unsplit,
    break_even_tokens,
    by_key,
    grid_layer_ops,
    grid_outside_ops,
    layer_wire,
    param_bytes_grid,
    param_bytes_unsplit,
)
from bench.tensor_parallel_grid.ranks import unsplit
from bench.tensor_parallel_grid.report import on_diagonal, outside_ops
from bench.tensor_parallel_grid.run import shapes

SHAPE = shapes(quick=True)["2D tp=4"]
NAME = "2D tp=4"


@pytest.fixture(scope="module")
def counted(ranks):
    from bench.tensor_parallel_grid.ranks import count

    from helpers.distributed import process_comm

    return [r[NAME] for r in ranks(4).run(count, SHAPE, (NAME,), process_comm)]


@pytest.fixture(scope="module")
def whole():
    """The unsplit model's parameter bytes and bytes saved per block, in this process."""
    measured = unsplit(SHAPE)
    assert measured["params"] == param_bytes_unsplit(SHAPE)
    assert measured["saved"][1] == activation_bytes_unsplit(SHAPE)
    return measured


@pytest.mark.slow  # the rank tests: 20-32 s alone on 2 cores, the 4-rank pool's start included
@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_collectives_per_layer_are_the_grid_formula(counted, pass_):
    want = by_key(grid_layer_ops(SHAPE)[pass_])
    for result in counted:
        assert not isinstance(result, str), result
        for block in result["blocks"]:  # no block holds more than a layer on the grid
            assert block[pass_]["ops"] == want


@pytest.mark.slow  # the rank tests: 20-32 s alone on 2 cores, the 4-rank pool's start included
@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_collectives_outside_the_layers_are_the_formula(counted, pass_):
    for rank, result in enumerate(counted):
        got = {(op, g): (c, round(c * b)) for op, g, c, b in outside_ops(result, pass_)}
        assert got == by_key(grid_outside_ops(SHAPE, on_diagonal(rank, SHAPE))[pass_]), rank


@pytest.mark.slow
def test_parameter_bytes_per_rank_are_a_quarter_of_the_unsplit_model(counted, whole):
    ideal = whole["params"] / SHAPE.side ** 2
    for result in counted:
        assert result["params"] == param_bytes_grid(SHAPE)
        assert abs(result["params"] / ideal - 1) <= 0.10, (result["params"], ideal)


@pytest.mark.slow
def test_saved_activations_per_layer_match_the_formula(counted, whole):
    ideal = whole["saved"][1] / SHAPE.side ** 2
    for result in counted:
        for saved in result["saved"][1:]:  # the first block also keeps the RoPE tables
            assert saved == activation_bytes_grid(SHAPE)
            assert abs(saved / ideal - 1) <= 0.10, (saved, ideal)


def test_the_grid_sends_less_than_1d_only_past_its_break_even():
    """Section 2's break-even b*s: ring bytes per layer equal 1D's there; 2x2 never gets there
    (per token 3(q-1)/q * (6h + f)/q = 6.75h against 1D's 8(t-1)/t h = 6h at f = 3h)."""
    model = SHAPE.sized(1, 1024)
    assert break_even_tokens(replace(model, side=2)) is None
    for q, d in ((2, 2), (4, 1), (4, 4)):
        grid = replace(model, side=q, depth=d)
        tokens = break_even_tokens(grid)
        for t, below in ((tokens * 0.9, False), (tokens * 1.1, True)):
            s = grid.sized(round(t / (q * d)) * q * d, 1024)
            assert (layer_wire(s) < layer_wire(s.one_d())) == below, (q, d, t)

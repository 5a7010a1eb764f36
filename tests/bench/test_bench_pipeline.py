"""The facts behind ``python -m bench pipeline``, on its quick model (HF GPT-2, 8 layers, h=32)
under pp=2 on 2 real gloo ranks (one bench run for the module, ~10 s on 2 idle cores), and
the pieces that need no ranks; nothing about time is asserted.

What is protected:
- (no ranks) replaying gpipe, 1f1b and interleaved with unit costs gives exactly
  (p-1)/(m+p-1) and (p-1)/(V*m+p-1) at pp=2 and pp=4, and zbv's replayed bubble is below
  1f1b's: the schedules are the ones the formulas describe;
- the quick bench's report prints its four sections and a headline, and returns a bubble per
  schedule measured at pp=2 and projected to pp=4 from that run's action times;
- on the first stage, 1F1B's peak activations (bytes autograd holds saved at once) are below
  GPipe's, at p/m of them, and torch.distributed.pipelining's stages hold what ours hold;
- every schedule, ours and torch's, gives the same first-step loss (same weights, same data),
  and only zbv defers weight gradients;
- (no ranks) the peak meter sees a backward free its micro-batch's saved tensors.
"""

from __future__ import annotations

import math

import pytest

from bench.pipeline.projection import formula, unit_replay
from bench.pipeline.ranks import OURS, THEIRS, Shape
from bench.pipeline.run import QUICK, report

SHAPE = Shape(**QUICK)
ROUNDS, STEPS = 2, 1


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [4, 8])
def test_unit_replays_are_the_formulas_and_zbv_is_below_1f1b(p, m):
    for name in ("gpipe", "1f1b", "interleaved"):
        assert unit_replay(name, p, m).bubble() == pytest.approx(formula(name, p, m),
                                                                 abs=1e-12)
    assert unit_replay("zbv", p, m).bubble() < unit_replay("1f1b", p, m).bubble()


@pytest.fixture(scope="module")
def measured(ranks):
    from bench.pipeline.ranks import run

    from helpers.distributed import process_comm

    return ranks(2).run(run, SHAPE, ROUNDS, STEPS, process_comm, timeout_s=600)


@pytest.mark.slow  # a 2-rank measurement (~5 s): make test-bench (tests/bench/conftest.py)
def test_report_has_its_sections_and_numbers(measured, capsys):
    summary = report(measured, SHAPE, ROUNDS, STEPS)
    out = capsys.readouterr().out
    for heading in ("\n1. bubble at pp=2", "\n2. pp=4, projected", "\n3. peak activation",
                    "\n4. step time", "\nheadline:"):
        assert heading in out
    assert "zbv" in out and "torch 1F1B" in out and "torch GPipe" in out
    for where in ("measured", "projected"):
        assert set(summary[where]) == set(OURS)
        assert all(0 <= b < 1 for b in summary[where].values())
    assert set(summary["speed"]) == set(THEIRS.values())


@pytest.mark.slow  # the same 2-rank measurement: make test-bench (the fast tier starts none)
def test_first_stage_holds_fewer_activations_under_1f1b(measured):
    first = next(r for r in measured if r["stage"] == 0)["peak"]
    assert first["1f1b"] < first["gpipe"]
    assert first["1f1b"] / first["gpipe"] == pytest.approx(SHAPE.pp / SHAPE.microbatches,
                                                          rel=0.05)
    for theirs, ours in THEIRS.items():
        assert first[theirs] == pytest.approx(first[ours], rel=0.01)


@pytest.mark.slow  # the same 2-rank measurement: make test-bench
def test_every_schedule_gives_the_same_loss(measured):
    last = next(r for r in measured if r["stage"] == SHAPE.pp - 1)["first_loss"]
    ours = [last[n] for n in OURS]
    assert all(not math.isnan(x) for x in last.values())
    assert max(ours) - min(ours) <= 1e-6 * abs(ours[0])
    for theirs in THEIRS:
        assert last[theirs] == pytest.approx(ours[0], rel=1e-5)
    for rank in measured:
        assert rank["first_loss"]["1f1b"] == pytest.approx(ours[0], rel=1e-6)
        assert rank["ours"]["zbv"]["deferred"] > 0
        assert all(rank["ours"][n]["deferred"] == 0 for n in OURS if n != "zbv")


def test_peak_saved_sees_backward_free_a_micro_batch():
    """The meter itself, in one process: two micro-batches forwarded before either backward
    hold twice what one forward-backward at a time holds."""
    import torch

    from kernels_runtime.calibrate.pipeline_memory import LiveSaved

    layer = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    batches = [torch.randn(8, 16) for _ in range(2)]
    with LiveSaved() as together:
        losses = [layer(x).sum() for x in batches]
        for loss in losses:
            loss.backward()
    del losses
    with LiveSaved() as one_at_a_time:
        for x in batches:
            layer(x).sum().backward()
    assert one_at_a_time.peak > 0 and one_at_a_time.live == {}
    assert together.peak == 2 * one_at_a_time.peak

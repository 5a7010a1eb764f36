"""Training curves travel with the telemetry, exactly as ``train_step`` and ``eval_step`` returned
them.

What is protected: on 2 real gloo ranks (dp=2), what each rank publishes under ``curves`` holds
one row per training step whose loss, stepped flag and global grad norm equal that step's
``StepResult`` exactly (not approximately: the same floats), whose LR is the optimizer's at that
step (an LR scheduler changes it), and the eval loss ``eval_step`` returned, at the step it
followed; step numbers restart at 1 in a new cell; and the notebook's ``CurveLog`` merging
overlapping windows keeps each step once.
"""

from __future__ import annotations

import torch

from kernels_runtime.telemetry.curves import TrainingCurves
from workbench.ui.dashboard.curves import CurveLog, smooth

from helpers.distributed import context

STEPS = 4


def _train_and_publish(rank: int, world: int) -> dict:
    from torch import nn

    from kernels_runtime import eval_step, parallelize, train_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             ctx=context("dp=2"), max_grad_norm=0.5, verbose=False)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    telemetry = opt.ctx.telemetry
    sent: list[dict] = []
    telemetry.new_cell()  # the pool's ranks are shared: start this test's "cell"
    telemetry.publisher.min_interval_s = 0.0  # every step publishes: each window is seen
    telemetry.set_publisher(sent.append)
    try:
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        batches = list(zip(x.chunk(2), y.chunk(2)))
        results, lrs = [], []

        def loss(m: nn.Module, b: tuple) -> torch.Tensor:
            return nn.functional.mse_loss(m(b[0]), b[1])

        for _ in range(STEPS):
            lrs.append(opt.param_groups[0]["lr"])
            results.append(train_step(model, opt, batches, loss))
            scheduler.step()
        evaluated = eval_step(model, batches, loss)
        telemetry.flush()
        published = [s["curves"] for s in sent if s.get("curves")]
        telemetry.new_cell()
        after = telemetry.curves.block()
    finally:
        telemetry.set_publisher(None)
        telemetry.publisher.min_interval_s = 0.25
    return {"results": [(r.loss, r.stepped, r.grad_norm) for r in results], "lrs": lrs,
            "eval": evaluated, "published": published, "after": after}


def test_published_curves_equal_the_step_results_exactly(ranks) -> None:
    out = ranks(2).run(_train_and_publish, timeout_s=120)
    for rank in out:
        last = rank["published"][-1]
        assert last["steps"] == STEPS and last["skipped"] == 0
        rows = [(s, loss, lr, norm, scale, stepped)
                for s, loss, lr, norm, scale, stepped in last["train"]]
        want = [(i + 1, loss, rank["lrs"][i], norm, None, stepped)
                for i, (loss, stepped, norm) in enumerate(rank["results"])]
        assert rows == want  # exact: the very floats the StepResults hold
        assert all(r[3] is not None and r[3] > 0 for r in rows)  # clipped: the norm is measured
        assert rank["lrs"] == [0.1, 0.05, 0.025, 0.0125]
        assert last["eval"] == [[STEPS, rank["eval"]]]
        assert rank["after"] is None  # a new cell starts its curves again
        # each step published once as it ran, windows overlapping: the log keeps each step once
        merged = CurveLog()
        for block in rank["published"]:
            merged.ingest(block)
        assert merged.series("loss") == (list(range(1, STEPS + 1)),
                                         [r[0] for r in rank["results"]])
        assert merged.series("eval loss") == ([STEPS], [rank["eval"]])
    # dp ranks agree: the loss is averaged over them and the grad norm is global
    assert out[0]["results"] == out[1]["results"]


def test_the_window_is_bounded_and_steps_restart_per_cell() -> None:
    curves = TrainingCurves(window=3)
    for i in range(5):
        curves.record_train(float(i), i != 2, None, 0.1, 1024.0)
    block = curves.block()
    assert [r[0] for r in block["train"]] == [3, 4, 5]
    assert block["steps"] == 5 and block["skipped"] == 1
    curves.new_cell()
    curves.record_train(1.5, True, 2.0, 0.1, None)
    assert curves.block()["train"] == [[1, 1.5, 0.1, 2.0, None, True]]


def test_smoothing_is_tensorboards_debiased_ema() -> None:
    values = [1.0, 2.0, 3.0]
    got = smooth(values, 0.6)
    assert got[0] == 1.0  # debiased: the first point is itself
    assert abs(got[1] - (0.6 * 0.4 * 1 + 0.4 * 2) / (1 - 0.36)) < 1e-12
    assert smooth(values, 0.0) == values

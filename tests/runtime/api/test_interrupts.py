"""A stop that reaches the two stages of a pipeline inside different parts of a step stops both
after that same step (issue 26's race).

Under ``pp=2`` the stages run a step a moment apart, so a stop pressed once reaches each inside a
different part of it: here the first stage in its forward of step 3 and the last stage in its
loss of step 3. ``train_step`` holds the signal until the step is applied, so both report the
KeyboardInterrupt after exactly 3 completed steps, with the parameters of a run that was never
interrupted. Before the fix the last stage raised inside its loss and the first stage waited
for its gradient until the collective timeout."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from helpers.distributed import context

STEP_TO_STOP = 2  # 0-based: the third step is the one interrupted


def _train(rank: int, world: int, interrupt: bool) -> tuple[int, str, list[float]]:
    from torch import nn

    from kernels_runtime import parallelize, train_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             ctx=context("pp=2 mb=2"), verbose=False)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    step, sent = 0, []

    def stop_here() -> None:
        if interrupt and step == STEP_TO_STOP and not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)  # once, as the notebook's stop button does

    if rank == 0:  # the first stage: inside its forward
        model.register_forward_pre_hook(lambda module, args: stop_here())

    def loss(model: nn.Module, batch: tuple) -> torch.Tensor:
        if rank == world - 1:  # the last stage: inside its loss
            stop_here()
        return nn.functional.mse_loss(model(batch[0]), batch[1])

    stopped = ""
    try:
        for step in range(5):
            train_step(model, opt, list(zip(x.chunk(2), y.chunk(2))), loss)
            if not interrupt and step == STEP_TO_STOP:
                break
    except KeyboardInterrupt as err:
        stopped = str(err)
    sums = [p.detach().sum().item() for p in model.parameters()]
    return model.parallel_state.schedule.steps, stopped, sums


@pytest.mark.parametrize("world", [2])
def test_one_stage_interrupted_mid_step_stops_both_after_that_step(ranks, world):
    stopped = ranks(world).run(_train, True)
    plain = ranks(world).run(_train, False)
    assert [s[0] for s in stopped] == [STEP_TO_STOP + 1] * world, stopped
    assert all("step that was running completed" in s[1] for s in stopped), stopped
    for (_, _, got), (_, _, want) in zip(stopped, plain):
        assert got == pytest.approx(want, abs=1e-6)

"""The cells every launcher's pool runs, and what their answers must be.

One data-parallel training cell on 4 ranks (a tiny MLP under ``dp=4``, each rank training on its
quarter of a seeded global batch, SGD) whose losses must equal, launcher after launcher, the
losses of the same model trained on the whole batch in one process: data parallelism's mean of
per-rank gradients is the full batch's gradient. And a ``dp=2 tp=2`` cell that asks each
tensor-parallel group which hosts its members run on.
"""

from __future__ import annotations

import torch

STEPS = 6
WORLD = 4
ROWS_PER_RANK = 8

DP_CELL = f"""
import torch
from torch import nn
from kernels_runtime.api import parallelize, train_step

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=0.2),
                         ctx=session.context(), verbose=False)

def mse(m, b):
    return nn.functional.mse_loss(m(b[0]), b[1])

losses = []
for step in range({STEPS}):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn({WORLD * ROWS_PER_RANK}, 6, generator=g)
    y = x.sum(1, keepdim=True).sin()
    mine = slice(rank * {ROWS_PER_RANK}, (rank + 1) * {ROWS_PER_RANK})
    losses.append(train_step(model, opt, [(x[mine], y[mine])], mse).loss)
print("losses", losses)
"""

TP_HOSTS_CELL = """
import socket
import torch.distributed as dist

ctx = session.context()
tp_hosts = [None] * ctx.size("tp")
dist.all_gather_object(tp_hosts, socket.gethostname(), group=ctx.group("tp"))
all_tp_hosts = [None] * world_size
dist.all_gather_object(all_tp_hosts, (rank, tp_hosts), group=None)
"""


def reference_losses() -> list[float]:
    """The DP cell's losses, trained in this process on the whole batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randn(WORLD * ROWS_PER_RANK, 6, generator=g)
        y = x.sum(1, keepdim=True).sin()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def assert_same_losses(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) == STEPS, (got, want)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-7)

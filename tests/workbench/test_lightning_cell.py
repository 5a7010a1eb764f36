"""A Lightning ``Trainer(strategy="ddp")`` in a ``%%colossal`` cell trains as DDP on the pool's
process group.

The ranks export torchrun's variables (``kernels_runtime.session.export_environment``), so
Lightning's ``LightningEnvironment`` sees ``LOCAL_RANK`` and takes the processes as launched
by someone else (no launcher of its own), and ``DDPStrategy.setup_distributed`` finds
``torch.distributed`` initialized and keeps the default group that exists
(``lightning.fabric.utilities.distributed._init_dist_connection`` returns early). What this
protects: a user's Lightning script runs unchanged in a cell, on the pool's ranks and group.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.engines, pytest.mark.full]

LIGHTNING_CELL = '''
import os
import torch, torch.distributed as dist
import lightning as L

group_before = dist.group.WORLD
backend_before = dist.get_backend()


class Regression(L.LightningModule):
    """A two-layer MLP on fixed rows; records each step's loss (this rank's micro-batch)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))
        self.losses, self.worlds, self.rows = [], [], []

    def training_step(self, batch, _index):
        x, y, row = batch  # (2, 6), (2, 1), (2,): this rank's half of the global batch of 4
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach())
        self.rows.append(row)
        self.worlds.append(dist.get_world_size())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


g = torch.Generator().manual_seed(7)
rows = torch.utils.data.TensorDataset(torch.randn(20, 6, generator=g),
                                      torch.randn(20, 1, generator=g), torch.arange(20))
loader = torch.utils.data.DataLoader(rows, batch_size=2, shuffle=False)
module = Regression()
trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, num_nodes=1, max_steps=5,
                    enable_progress_bar=False, logger=False, enable_checkpointing=False,
                    enable_model_summary=False)
trainer.fit(module, loader)
mine = torch.stack(module.losses)  # (5,)
dist.all_reduce(mine)  # the mean over ranks of equal micro-batches = the global batch's mean
losses = (mine / dist.get_world_size()).tolist()
drawn = [torch.zeros(5, 2, dtype=torch.long) for _ in range(dist.get_world_size())]
dist.all_gather(drawn, torch.stack(module.rows))  # (5, 2) row ids per rank
step_rows = torch.cat(drawn, dim=1).tolist()  # (5, 4): each step's global batch
seen = {"trainer_world": trainer.world_size, "step_worlds": sorted(set(module.worlds)),
        "same_group": dist.group.WORLD is group_before,
        "backend": (backend_before, dist.get_backend()),
        "environment": type(trainer.strategy.cluster_environment).__name__,
        "world_size_after_fit": os.environ.get("WORLD_SIZE")}
'''


def reference_losses(step_rows: list[list[int]]) -> list[float]:
    """One process, the same model and rows, each step on the union of both ranks' micro-batches
    (the row ids the ranks drew: Lightning puts a shuffling DistributedSampler on a training
    loader), whose mean-loss gradient is DDP's average of the ranks' gradients."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(20, 6, generator=g), torch.randn(20, 1, generator=g)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for rows in step_rows:
        loss = torch.nn.functional.mse_loss(net(x[rows]), y[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_lightning_ddp_in_a_cell_trains_on_the_pools_group(shell):
    """Lightning sees world size 2, keeps the pool's default group (same object, gloo), its
    cluster environment is the one that reads our exported variables, the variables its
    teardown deletes are back in the next cell (for that cell's HF or accelerate code), and
    the five
    losses equal one process on the union of both ranks' rows within 1e-4."""
    assert shell.run_cell_magic("colossal", "--pull losses,step_rows,seen", LIGHTNING_CELL) is None
    seen, losses = shell.user_ns["seen"], shell.user_ns["losses"]
    assert seen["trainer_world"] == 2 and seen["step_worlds"] == [2], seen
    assert seen["same_group"] and seen["backend"] == ("gloo", "gloo"), seen
    assert seen["environment"] == "LightningEnvironment", seen
    # LightningEnvironment.teardown deletes WORLD_SIZE; the rank exports it again before
    # the next cell (RankSession.restore_environment)
    assert seen["world_size_after_fit"] is None, seen
    shell.run_cell_magic("colossal", "--pull env", "import os\n"
                         "env = {k: os.environ.get(k) for k in ('RANK', 'WORLD_SIZE')}")
    assert shell.user_ns["env"] == {"RANK": "0", "WORLD_SIZE": "2"}, shell.user_ns["env"]
    step_rows = shell.user_ns["step_rows"]
    assert len(step_rows) == 5 and all(len(set(r)) == 4 for r in step_rows), step_rows
    want = reference_losses(step_rows)
    assert len(losses) == 5
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, want)) < 1e-4, (losses, want)

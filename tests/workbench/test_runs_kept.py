"""A real ``%%colossal`` training cell (dp=2, real engines, gloo) keeps its run: TensorBoard's
own ``EventAccumulator`` reads from the run directory exactly the losses the cell returned, the
dashboard's curves panel draws them, and ``compare`` draws the run from its directory alone.

What is protected end to end: ``train_step`` on the ranks records each ``StepResult``, the
telemetry carries it through datapub to the notebook, the cell's ``LiveDashboard`` keeps the run
when the cell ends, and nothing on the way rounds a loss (float32 TensorBoard scalars would).
"""

from __future__ import annotations

import pytest

import workbench
from workbench.dashboard import runs
from workbench.dashboard.compare import read_run_dir
from workbench.dashboard.figures import trace_data

CELL = """
import torch
from kernels_runtime.api import eval_step, parallelize, train_step
from kernels_runtime.mesh.context import ParallelContext

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64))
model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=0.5),
                         ctx=ParallelContext.build(plan, comm), verbose=False)

def loss_fn(m, batch):
    return torch.nn.functional.cross_entropy(m(batch[0]).flatten(0, 1), batch[1].flatten())

def batch(step):
    g = torch.Generator().manual_seed(2 * step + rank)
    ids = torch.randint(0, 64, (4, 8), generator=g)  # (b, s)
    return [(ids, ids)]

losses = [train_step(model, opt, batch(step), loss_fn).loss for step in range(5)]
evaluated = eval_step(model, batch(99), loss_fn)
"""


def _read_losses(path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(path), size_guidance={"tensors": 0})
    events.Reload()
    return [tensor_util.make_ndarray(e.tensor_proto).item() for e in events.Tensors("train/loss")]


@pytest.mark.engines
def test_a_training_cell_keeps_its_run_read_back_exactly(shell) -> None:
    before = len(runs.SESSION_RUNS)
    shell.run_cell_magic("colossal", '--plan "dp=2 zero=1" --dashboard --pull losses,evaluated',
                         CELL)
    assert len(runs.SESSION_RUNS) == before + 1
    kept = runs.SESSION_RUNS[-1]
    losses = shell.user_ns["losses"]
    path = kept.wait()
    assert path is not None and (path / "run.json").is_file()
    assert _read_losses(path) == losses  # exact: the floats the cell returned
    curves = trace_data(workbench.show_dashboard().curve_figure)
    assert curves["curves: loss"] == (list(range(1, 6)), losses)
    assert curves["curves: eval loss"] == ([5], [shell.user_ns["evaluated"]])
    assert kept.plan == "dp=2 zero_stage=1"
    # after a restart only the directory is left: compare reads it with the plan in the legend
    fig = workbench.compare(path, -1)
    assert [t.name for t in fig.data if t.showlegend is not False] == [
        "dp=2 zero_stage=1 (#1)", "dp=2 zero_stage=1 (#2)"]
    assert read_run_dir(path).loss == (list(range(1, 6)), losses)

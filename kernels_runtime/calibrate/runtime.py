"""The runtime's own fixed costs: what a step costs beyond its FLOPs, bytes and collectives.

Python, module and autograd hooks, kernel launches, the loss average and other small
collectives do not scale with the model's width, so they are measured on a model so narrow
that its compute is negligible: ``parallelize`` + ``train_step`` of a proxy LM for each ZeRO
stage at (1 layer, 1 micro-batch), (4 layers, 1), (1 layer, 2 micro-batches), which solves
    t(L, m) = step + m * (micro + L * layer).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from kernels_runtime.calibrate.proxy import ProxyLM
from kernels_runtime.calibrate.timing import timed
from kernels_runtime.comm import Collectives


def runtime_overheads(stages: tuple[int, ...], reps: int) -> dict[str, dict[str, float]]:
    """Seconds per step, per micro-batch and per layer-micro-batch, per ZeRO stage."""
    from kernels_runtime.api import parallelize, train_step
    from kernels_runtime.mesh.context import ParallelContext

    world = dist.get_world_size()
    base = ParallelContext.build(f"dp={world}", Collectives())
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1], tokens[:, 1:])

    def loss_fn(model: nn.Module, mb: tuple) -> torch.Tensor:
        x, y = mb
        return nn.functional.cross_entropy(model(x).reshape(-1, 32), y.reshape(-1))

    def step_time(stage: int, layers: int, micro: int) -> float:
        torch.manual_seed(0)
        model = ProxyLM(layers)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, bopt = parallelize(model, opt, ctx=base.with_plan(f"dp={world} zero={stage}"))
        mbs = [(batch[0][i::micro], batch[1][i::micro]) for i in range(micro)]
        return timed(lambda: train_step(model, bopt, mbs, loss_fn), lambda: None, 0.0, reps)

    out = {}
    for stage in stages:
        t11, t41, t12 = step_time(stage, 1, 1), step_time(stage, 4, 1), step_time(stage, 1, 2)
        layer = max(0.0, (t41 - t11) / 3)
        micro = max(0.0, t12 - t11 - layer)
        out[str(stage)] = {"step": max(0.0, t11 - micro - layer), "micro": micro,
                           "layer": layer}
    return out

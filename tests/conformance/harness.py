"""One conformance cell: a family trained under a plan on real ranks, against the unsplit model
trained in this process.

How every parameter's gradient is read under any layout: the optimizer is SGD with momentum,
whose momentum buffer after the first step *is* that step's gradient (torch's first step copies
the gradient into the buffer). The buffer is optimizer state, so the model state's written
pieces (``optimizer.pieces(saving=True)``: each element of each parameter written by exactly
one rank, whatever shards it, on device, host or disk) carry it in global coordinates; the
pieces are placed into full tensors here and compared parameter by parameter. The losses of
three steps compare the updates (and so the outputs) after it.

The reference averages the loss over the same pieces of the batch the plan trains on (each
data-parallel rank's rows, each of its micro-batches), as data parallelism defines the loss.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from conformance.families import FAMILIES, Family, pieces_of, smollm2_folder

STEPS, MOMENTUM = 3, 0.9
RTOL = 1e-5  # relative L2 per parameter gradient, relative per loss
ATOL = 1e-8  # absolute, for a gradient whose reference norm is below TINY
TINY = 1e-6
# one file per test tier (make test, make test-full), so the report joins both tiers' cells
RESULTS = Path(os.environ.get("WORKBENCH_CONFORMANCE_RESULTS", "artifacts/tests")) / \
    f"conformance-{os.environ.get('WORKBENCH_TEST_TIER') or 'any'}.jsonl"


def batch_split(plan: str, world: int) -> tuple[int, int]:
    """(data-parallel ranks, micro-batches per rank): how the plan splits the batch."""
    from kernels_runtime.mesh.plan import Plan

    p = Plan.parse(plan).validate(world)
    return p.dp, p.microbatches


Wrap = Callable[[Family, nn.Module], nn.Module]  # the built model -> the model trained


def reference(family: Family, dp: int, microbatches: int, wrap: Wrap | None = None,
              steps: int = STEPS) -> dict:
    """Losses of ``steps`` steps and the first step's gradient of every parameter, in one
    process (of each parameter given one: ``wrap`` may freeze some, as LoRA does)."""
    model = family.build() if wrap is None else wrap(family, family.build())
    opt = torch.optim.SGD(model.parameters(), lr=family.lr, momentum=MOMENTUM)
    losses, grads = [], {}
    for step in range(steps):
        parts = [mb for rank in pieces_of(family, step, dp, microbatches) for mb in rank]
        total = 0.0
        for batch in parts:
            loss = model(**batch).loss / len(parts)
            loss.backward()
            total += loss.item()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                     if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "grads": grads}


def train_on_rank(rank: int, world: int, family_name: str, plan: str,
                  smollm2: str | None = None, wrap: Wrap | None = None,
                  steps: int = STEPS) -> dict:
    """The rank's side: parallelize, ``steps`` train_steps on its pieces, the first step's
    gradient pieces it writes, and the frozen parameters holding a gradient after it (none
    may). A plan refused by ``parallelize``, or a batch it cannot split refused by the first
    step, returns its message. ``wrap``: as ``reference``'s, a module-level function."""
    from kernels_runtime import parallelize, train_step
    from kernels_runtime.mesh.plan import PlanError

    from helpers.distributed import context

    if smollm2 is not None:  # the cut checkpoint's folder, made by the test session
        smollm2_folder(Path(smollm2))
    family = FAMILIES[family_name]
    model = family.build() if wrap is None else wrap(family, family.build())
    try:
        ctx = context(plan)
        model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=family.lr,
                                                        momentum=MOMENTUM),
                                 ctx=ctx, verbose=False)
    except (PlanError, ValueError, NotImplementedError) as e:
        return {"refused": f"{type(e).__name__}: {e}"}
    losses, grads, frozen_grads = [], [], []
    for step in range(steps):
        mine = pieces_of(family, step, ctx.dp_size, ctx.plan.microbatches)[ctx.dp_rank]
        try:
            losses.append(train_step(model, opt, mine).loss)
        except ValueError as e:  # a batch the plan cannot split: raised on every rank alike
            if step:
                raise
            return {"refused": f"{type(e).__name__}: {e}"}
        if step == 0:
            grads = [(p.shard.name, p.shard.offsets, p.shard.sizes,
                      p.values["momentum_buffer"].detach().float().clone())
                     for p in opt.pieces(saving=True) if "momentum_buffer" in p.values]
            frozen_grads = [n for n, p in model.named_parameters()
                            if not p.requires_grad and p.grad is not None]
    return {"losses": losses, "grads": grads, "frozen_grads": frozen_grads}


@dataclass
class Cell:
    family: str
    plan: str
    ranks: int
    outcome: str = "pass"  # pass | fail | refused
    loss_rel: float = 0.0  # the largest over the steps
    grad_rel: float = 0.0  # the largest over the parameters
    worst: str = ""  # the parameter with the largest gradient error
    message: str = ""
    problems: list[str] = field(default_factory=list)

    def record(self) -> None:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        with RESULTS.open("a") as f:
            f.write(json.dumps(asdict(self)) + "\n")


def compare(cell: Cell, ref: dict, results: list[dict]) -> Cell:
    """Losses on every rank, and each reference gradient against the pieces assembled."""
    for r, result in enumerate(results):
        rel = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], ref["losses"]))
        cell.loss_rel = max(cell.loss_rel, rel)
        if rel > RTOL:
            cell.problems.append(f"rank {r} losses {result['losses']} != {ref['losses']}")
    written: dict[str, torch.Tensor] = {}
    for name, want in ref["grads"].items():
        got, count = torch.zeros_like(want), torch.zeros_like(want)
        for result in results:
            for piece_name, offsets, sizes, grad in result["grads"]:
                if piece_name == name:
                    box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                    got[box] += grad
                    count[box] += 1
        written[name] = count
        if not bool((count == 1).all()):
            cell.problems.append(f"{name}: {int((count == 0).sum())} elements not written, "
                                 f"{int((count > 1).sum())} written twice")
            continue
        if want.norm() < TINY:
            err, bad = (got - want).abs().max().item(), (got - want).abs().max() > ATOL
        else:
            err = ((got - want).norm() / want.norm()).item()
            bad = err > RTOL
        if err > cell.grad_rel:
            cell.grad_rel, cell.worst = err, name
        if bad:
            cell.problems.append(f"{name}: gradient error {err:.2e}")
    unknown = {n for result in results for n, *_ in result["grads"]} - set(ref["grads"])
    if unknown:
        cell.problems.append(f"pieces of parameters the model does not have: {sorted(unknown)}")
    cell.outcome = "fail" if cell.problems else "pass"
    return cell

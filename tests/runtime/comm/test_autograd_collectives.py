"""Differentiable collectives: each primitive's backward is its forward's exact adjoint.

What is protected: on 2 and 4 real gloo ranks, in float64, the gradient autograd returns on
every rank through ``kernels_runtime.comm.autograd`` equals the analytic gradient of the same
computation written for one process over all ranks' tensors (the forward's meaning: sums,
concatenations, chunks). Inputs marked replicated are one tensor held by every rank (its
gradient sums every rank's use); outputs marked replicated feed a loss that every rank
computes identically and that counts once, as a tensor-parallel region's output does.
"""

from __future__ import annotations

import pytest
import torch

from helpers.distributed import process_comm
from helpers.tier_guard import on_ranks

SHAPE = (4, 8, 4)  # every dim divides by 2 and 4 ranks


def _cat(xs, dim):
    return torch.cat(list(xs), dim)


def _chunk(x, n, dim, i):
    return x.chunk(n, dim)[i]


# name -> (input replicated, output replicated, meaning: (all inputs, rank, P) -> that rank's
# output, call on a rank)
CASES = {
    "copy_to_group": (True, False, lambda xs, r, n: xs[r],
                      lambda f, x, c: f.copy_to_group(x, c, None)),
    "reduce_from_group": (False, True, lambda xs, r, n: sum(xs),
                          lambda f, x, c: f.reduce_from_group(x, c, None)),
    "gather_split": (False, True, lambda xs, r, n: _cat(xs, 1),
                     lambda f, x, c: f.gather_from_group(x, c, None, 1, "split")),
    "gather_reduce_scatter": (False, False, lambda xs, r, n: _cat(xs, 2),
                              lambda f, x, c: f.gather_from_group(x, c, None, 2,
                                                                  "reduce_scatter")),
    "scatter_to_group": (True, False, lambda xs, r, n: _chunk(xs[r], n, 1, r),
                         lambda f, x, c: f.scatter_to_group(x, c, None, 1)),
    "reduce_scatter_to_group": (False, False, lambda xs, r, n: _chunk(sum(xs), n, 0, r),
                                lambda f, x, c: f.reduce_scatter_to_group(x, c, None, 0)),
    "all_to_all": (False, False,
                   lambda xs, r, n: _cat([_chunk(x, n, 1, r) for x in xs], 2),
                   lambda f, x, c: f.all_to_all(x, c, None, 1, 2)),
}


def _inputs(world: int, replicated_in: bool, replicated_out: bool, out_shape) -> tuple:
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(SHAPE, generator=g, dtype=torch.float64) for _ in range(world)]
    if replicated_in:
        xs = [xs[0]] * world
    ws = [torch.randn(out_shape, generator=g, dtype=torch.float64) for _ in range(world)]
    if replicated_out:
        ws = [ws[0]] * world
    return xs, ws


def _out_shape(name: str, world: int) -> tuple[int, ...]:
    xs = [torch.zeros(SHAPE) for _ in range(world)]
    return tuple(CASES[name][2](xs, 0, world).shape)


def _distributed(rank: int, world: int, name: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    from kernels_runtime.comm import autograd

    replicated_in, replicated_out, _, call = CASES[name]
    comm = process_comm()
    comm.stats.reset()
    xs, ws = _inputs(world, replicated_in, replicated_out, _out_shape(name, world))
    x = xs[rank].clone().requires_grad_(True)
    out = call(autograd, x, comm)
    (out * ws[rank]).sum().backward()
    return out.detach(), x.grad, comm.stats.totals()


def _reference(world: int, name: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    replicated_in, replicated_out, meaning, _ = CASES[name]
    xs, ws = _inputs(world, replicated_in, replicated_out, _out_shape(name, world))
    if replicated_in:
        leaf = xs[0].clone().requires_grad_(True)
        leaves = [leaf] * world
    else:
        leaves = [x.clone().requires_grad_(True) for x in xs]
    outs = [meaning(leaves, r, world) for r in range(world)]
    terms = [outs[0] * ws[0]] if replicated_out else [o * w for o, w in zip(outs, ws)]
    sum(t.sum() for t in terms).backward()
    return [o.detach() for o in outs], [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("world", [2, on_ranks(4)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_backward_equals_the_analytic_gradient(ranks, world, name):
    results = ranks(world).run(_distributed, name)
    outs, grads = _reference(world, name)
    for rank, (out, grad, totals) in enumerate(results):
        torch.testing.assert_close(out, outs[rank], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, grads[rank], rtol=1e-12, atol=1e-12)
        assert totals["calls"] >= 1, "the collectives bypassed the instrumented Collectives"


def _single_rank_is_identity(rank: int, world: int) -> bool:
    import torch.distributed as dist

    from kernels_runtime.comm import autograd

    solo = dist.new_group([rank]) if world == 1 else None
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    return autograd.reduce_from_group(x, process_comm(), solo) is x


def test_a_group_of_one_passes_tensors_through(ranks):
    assert ranks(1).run(_single_rank_is_identity) == [True]

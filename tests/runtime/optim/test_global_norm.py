"""The optimizer step's reductions over every axis: global gradient norm and overflow vote.

What is protected: on 4 real ranks laid out dp=2 x tp=2, gradients split by rows over tp and
replicated over dp, split over tp and again over dp (ZeRO over a tp shard), and replicated
everywhere (a LayerNorm weight) give the single-process norm of the whole gradient to 1e-6:
every element is counted exactly once. Data parallelism alone (DDP) needs no collective for
it. An inf on one rank makes every rank skip.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers.distributed import context

ROWS, COLS = 8, 6


def _full_gradients() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"weight": torch.randn(ROWS, COLS, generator=g),  # rows over tp, replicated over dp
            "zero_over_tp": torch.randn(4, 10, generator=g),  # columns over tp, flat over dp
            "norm": torch.randn(COLS, generator=g)}  # replicated everywhere


def _norm(rank: int, world: int) -> dict:
    from kernels_runtime.optim import GradShard, any_rank_overflowed, global_grad_norm

    ctx = context("dp=2 tp=2")
    dp, tp = ctx.coord("dp"), ctx.coord("tp")
    full = _full_gradients()
    rows = full["weight"].chunk(2, 0)[tp]  # (ROWS/2, COLS): this tp rank's rows
    columns = full["zero_over_tp"].chunk(2, 1)[tp].reshape(-1)  # (4*5,) flattened tp shard
    zero_shard = columns.chunk(2)[dp]  # (10,): this dp rank's flat half of it
    shards = [GradShard(rows, frozenset({"tp"})), GradShard(zero_shard, frozenset({"tp", "dp"})),
              GradShard(full["norm"], frozenset())]
    ctx.comm.stats.reset()
    norm = global_grad_norm(shards, ctx)
    calls = ctx.comm.stats.totals()["calls"]
    ddp_only = global_grad_norm([GradShard(full["norm"], frozenset())], ctx)
    ddp_calls = ctx.comm.stats.totals()["calls"] - calls
    found = torch.tensor(1.0 if rank == 3 else 0.0)
    return {"norm": norm, "calls": calls, "ddp": ddp_only, "ddp_calls": ddp_calls,
            "skip": any_rank_overflowed(found, ctx)}


@pytest.mark.slow  # 4 ranks
def test_global_norm_counts_every_element_once(ranks):
    expected = math.sqrt(sum(t.pow(2).sum().item() for t in _full_gradients().values()))
    for result in ranks(4).run(_norm):
        assert abs(result["norm"] - expected) <= 1e-6 * expected, (result["norm"], expected)
        assert result["calls"] == 1  # one all-reduce over the world spans dp and tp
        norm = _full_gradients()["norm"]
        assert abs(result["ddp"] - norm.norm().item()) <= 1e-6 * norm.norm().item()
        assert result["ddp_calls"] == 0  # replicated gradients: every rank knows the norm
        assert result["skip"] is True

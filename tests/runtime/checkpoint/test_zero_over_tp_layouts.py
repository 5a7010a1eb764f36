"""ZeRO over tensor-parallel layouts: the seam later strategies build on, end to end.

What is protected: a parameter laid out as a fused QKV split by heads (three boxes of the
global weight: this rank's heads of q, k and v), a row-parallel weight (one box) and a
replicated bias, sharded again by ZeRO-2 over dp on a dp=2 x tp=2 mesh, take an optimizer step
and save; the checkpoint holds the global tensors, fp32 masters and AdamW moments alike, equal
to one AdamW step on the whole tensors in one process, and loads exactly both back into the
same layout and into whole replicated tensors under dp=4.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.distributed import context

HIDDEN, HEADS, IN = 8, 2, 4  # c_attn: (IN, 3 * HIDDEN), columns [q | k | v], 2 heads each
SHAPES = {"qkv": (IN, 3 * HIDDEN), "proj": (HIDDEN, 6), "bias": (HIDDEN,)}
LR = 0.1


def _global(name: str, what: str = "param") -> torch.Tensor:
    n = 1
    for d in SHAPES[name]:
        n *= d
    base = torch.arange(n, dtype=torch.float32).reshape(SHAPES[name]) / n
    return base if what == "param" else torch.cos(base * 7 + len(name))  # the gradient


def _layouts(tp: int, rank: int):
    from kernels_runtime.mesh.shards import ParamLayout

    head = HIDDEN // HEADS  # columns per head
    per_rank = HEADS // tp * head
    blocks = tuple(((0, part * per_rank), (0, part * HIDDEN + rank * per_rank), (IN, per_rank))
                   for part in range(3))  # this rank's heads of q, of k, of v
    rows = HIDDEN // tp
    return {
        "qkv": ParamLayout(SHAPES["qkv"], blocks, frozenset({"tp"})),
        "proj": ParamLayout.box(SHAPES["proj"], (rank * rows, 0), (rows, 6), frozenset({"tp"})),
    }, blocks, rows


def _local(name: str, tp: int, rank: int, what: str = "param") -> torch.Tensor:
    full = _global(name, what)
    if tp == 1 or name == "bias":
        return full.clone()
    _, blocks, rows = _layouts(tp, rank)
    if name == "qkv":
        return torch.cat([full[:, g[1]:g[1] + s[1]] for _, g, s in blocks], dim=1)
    return full[rank * rows:(rank + 1) * rows].clone()


def _build(ctx, zero: int):
    from kernels_runtime.optim import BoostedOptimizer
    from kernels_runtime.parallel.data.zero import ZeroGradSync
    from kernels_runtime.parallel.state import ParallelState
    from kernels_runtime.policies import GenericPolicy

    tp, rank = ctx.size("tp"), ctx.coord("tp")
    layouts = _layouts(tp, rank)[0] if tp > 1 else {}
    model = nn.Module()
    for name in SHAPES:
        model.register_parameter(name, nn.Parameter(_local(name, tp, rank)))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sync = ZeroGradSync(model, opt, ctx, layouts, zero_stage=zero, precision="fp32")
    model.__dict__["parallel_state"] = ParallelState(ctx, GenericPolicy(), layouts=layouts,
                                                     grad_sync=sync, model_state=sync)
    return model, BoostedOptimizer(opt, sync, ctx, "fp32", None)


def _held(opt) -> dict:
    return {(p.shard.name, p.shard.offsets, p.shard.sizes): {k: v.clone() for k, v in
                                                             p.values.items()}
            for p in opt.pieces(saving=False)}


def _run(rank: int, world: int, root: str) -> dict:
    from kernels_runtime import load, save

    ctx = context("dp=2 tp=2")
    model, opt = _build(ctx, zero=2)
    tp, t = ctx.size("tp"), ctx.coord("tp")
    loss = sum((p * _local(n, tp, t, "grad")).sum() for n, p in model.named_parameters())
    opt.backward(loss)
    opt.step()
    saved = _held(opt)
    save(root, model, opt, step=1)
    same, same_opt = _build(ctx, zero=2)
    load(root, same, same_opt)
    whole, whole_opt = _build(context("dp=4"), zero=1)
    load(root, whole, whole_opt)
    return {"saved": saved, "same": _held(same_opt), "whole": _held(whole_opt),
            "local": {n: p.detach().clone() for n, p in same.named_parameters()}}


def _reference() -> dict[str, dict[str, torch.Tensor]]:
    """One AdamW step on the whole tensors, in this process."""
    params = {n: nn.Parameter(_global(n)) for n in SHAPES}
    opt = torch.optim.AdamW(params.values(), lr=LR, weight_decay=0.0)
    for n, p in params.items():
        p.grad = _global(n, "grad")
    opt.step()
    return {n: {"param": p.detach(), "exp_avg": opt.state[p]["exp_avg"],
                "exp_avg_sq": opt.state[p]["exp_avg_sq"]} for n, p in params.items()}


def _box(t: torch.Tensor, offsets, sizes) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]


@pytest.mark.slow  # 4 ranks
def test_zero_over_fused_qkv_and_row_shards_saves_and_reshards(ranks, tmp_path):
    reference = _reference()
    results = ranks(4).run(_run, str(tmp_path / "ckpt"))
    for rank, result in enumerate(results):
        for kind in ("saved", "same", "whole"):
            for (name, offsets, sizes), values in result[kind].items():
                for key, value in values.items():
                    want = _box(reference[name][key], offsets, sizes)
                    torch.testing.assert_close(value, want, rtol=1e-6, atol=1e-7,
                                               msg=f"rank {rank} {kind} {name} {key}")
        tp_rank = rank % 2
        for name, value in result["local"].items():  # the model's own tensors were refilled
            full = reference[name]["param"]
            if name == "qkv":
                _, blocks, _ = _layouts(2, tp_rank)
                want = torch.cat([full[:, g[1]:g[1] + s[1]] for _, g, s in blocks], dim=1)
            elif name == "proj":
                want = full[tp_rank * 4:(tp_rank + 1) * 4]
            else:
                want = full
            torch.testing.assert_close(value, want, rtol=1e-6, atol=1e-7, msg=name)
    from kernels_runtime.mesh.shards import Shard, tiling_problem

    for name, shape in SHAPES.items():  # under dp=4 zero=1 the 4 ranks' shards tile each tensor
        shards = [Shard(n, shape, o, s) for r in results for (n, o, s) in r["whole"] if n == name]
        assert tiling_problem(shape, shards) is None, name

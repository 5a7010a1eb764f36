"""1D tensor-parallel layers against the same computation in one process.

What is protected: on 2 and 4 real gloo ranks (float64), a column-parallel then row-parallel
MLP (``nn.Linear`` and GPT-2's transposed ``Conv1D`` storage), a fused QKV projection split by
heads, a vocabulary-parallel embedding with a vocabulary that does not divide by tp (padded),
and the vocabulary-parallel cross-entropy (with ignored targets) give the single-process
outputs and, assembled from every rank's shard through its layout, every parameter's gradient
(1e-10 relative).
"""

from __future__ import annotations

import pytest
import torch

from helpers.distributed import process_comm
from helpers.tier_guard import on_ranks

B, S, H, F, V = 2, 3, 8, 16, 10


def _data(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return {"x": r(B, S, H), "w1": r(F, H), "b1": r(F), "w2": r(H, F), "b2": r(H),
            "qkv": r(H, 3 * H), "qkv_b": r(3 * H), "emb": r(V, H), "head": r(V, H),
            "ids": torch.randint(0, V, (B, S), generator=g), "upstream": r(B, S, H)}


def _reference() -> dict[str, torch.Tensor]:
    d = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in _data().items()}
    h = torch.nn.functional.gelu(d["x"] @ d["w1"].t() + d["b1"])
    mlp = h @ d["w2"].t() + d["b2"]
    qkv = d["x"] @ d["qkv"] + d["qkv_b"]  # Conv1D storage: (in, 3h)
    emb = torch.nn.functional.embedding(d["ids"], d["emb"])
    logits = (emb + mlp) @ d["head"].t()  # (b, s, V)
    target = d["ids"].roll(1, -1).reshape(-1).clone()
    target[::4] = -100
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, V), target, ignore_index=-100)
    total = ce + (qkv * qkv.detach().cos()).sum() + (mlp * d["upstream"]).sum()
    total.backward()
    out = {k: d[k].grad for k in ("x", "w1", "b1", "w2", "b2", "qkv", "qkv_b", "emb", "head")}
    return {**{f"grad_{k}": v for k, v in out.items()}, "mlp": mlp.detach(), "qkv": qkv.detach(),
            "ce": ce.detach()}


def _parallel(rank: int, world: int) -> dict:
    from kernels_runtime.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
    from kernels_runtime.parallel.tensor.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )
    from kernels_runtime.parallel.tensor.sharding import split_dim, split_vocab, vocab_range

    comm, group, d = process_comm(), None, _data()
    x = d["x"].clone().requires_grad_(True)
    w1, l_w1 = split_dim(d["w1"], 0, rank, world)
    b1, l_b1 = split_dim(d["b1"], 0, rank, world)
    w2, l_w2 = split_dim(d["w2"], 1, rank, world)
    up = ColumnParallelLinear(w1, b1, comm, group)
    down = RowParallelLinear(w2, d["b2"].clone(), comm, group)
    mlp = down(torch.nn.functional.gelu(up(x)))
    qkv_w, l_qkv = split_dim(d["qkv"], 1, rank, world, parts=3)  # (in, 3h/tp), by heads
    qkv_b, l_qkv_b = split_dim(d["qkv_b"], 0, rank, world, parts=3)
    qkv = ColumnParallelLinear(qkv_w, qkv_b, comm, group, transposed=True, gather_output=True)
    start, held, _ = vocab_range(V, rank, world)
    emb_w, l_emb = split_vocab(d["emb"], rank, world)
    head_w, l_head = split_vocab(d["head"], rank, world)
    emb = VocabParallelEmbedding(emb_w, start, held, comm, group)
    head = ColumnParallelLinear(head_w, None, comm, group)
    logits = head(emb(d["ids"]) + mlp)  # (b, s, V/tp padded)
    target = d["ids"].roll(1, -1).reshape(-1).clone()
    target[::4] = -100
    ce = vocab_parallel_cross_entropy(logits.reshape(B * S, -1), target, start, held, comm,
                                      group)
    q = qkv(x)  # (b, s, 3h) gathered: [q_r0 k_r0 v_r0 | q_r1 ...] per rank
    q_global = torch.cat([q[..., r * 3 * H // world:(r + 1) * 3 * H // world].reshape(
        B, S, 3, H // world) for r in range(world)], dim=-1).reshape(B, S, 3 * H)
    # every rank computes the same loss, as ranks of a tensor-parallel group do
    total = ce + (q_global * q_global.detach().cos()).sum() + (mlp * d["upstream"]).sum()
    total.backward()
    grads = {"w1": (up.weight.grad, l_w1), "b1": (up.bias.grad, l_b1),
             "w2": (down.weight.grad, l_w2), "qkv": (qkv.weight.grad, l_qkv),
             "qkv_b": (qkv.bias.grad, l_qkv_b), "emb": (emb.weight.grad, l_emb),
             "head": (head.weight.grad, l_head)}
    placed = {}
    for name, (grad, layout) in grads.items():
        box = ((0,) * grad.dim(), tuple(grad.shape))
        placed[name] = [(s.offsets, s.sizes, grad[where].detach())
                        for s, where in layout.shards(name, box)]
    return {"placed": placed, "x": x.grad, "b2": down.bias.grad, "mlp": mlp.detach(),
            "qkv": q_global.detach(), "ce": ce.detach()}


@pytest.mark.parametrize("world", [2, on_ranks(4)])
def test_tensor_parallel_layers_match_one_process(ranks, world):
    ref = _reference()
    results = ranks(world).run(_parallel)
    opts = {"rtol": 1e-10, "atol": 1e-12}
    for result in results:
        torch.testing.assert_close(result["mlp"], ref["mlp"], **opts)
        torch.testing.assert_close(result["qkv"], ref["qkv"], **opts)
        torch.testing.assert_close(result["ce"], ref["ce"], **opts)
    for result in results:  # replicated tensors: every rank holds the whole gradient
        torch.testing.assert_close(result["x"], ref["grad_x"], **opts)
        torch.testing.assert_close(result["b2"], ref["grad_b2"], **opts)
    for name in ("w1", "b1", "w2", "qkv", "qkv_b", "emb", "head"):
        assembled = torch.zeros_like(ref[f"grad_{name}"])
        covered = torch.zeros_like(assembled, dtype=torch.int64)
        for result in results:
            for offsets, sizes, grad in result["placed"][name]:
                where = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                assembled[where] += grad
                covered[where] += 1
        assert bool((covered == 1).all()), f"{name}: shards do not tile it once"
        torch.testing.assert_close(assembled, ref[f"grad_{name}"], **opts, msg=name)

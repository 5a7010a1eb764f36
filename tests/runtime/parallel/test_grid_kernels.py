"""2D (SUMMA) and 2.5D (Tesseract) tensor-parallel kernels against the unsplit torch ops.

What is protected: on real gloo ranks, "tp=4 tp_mode=2d" (q=2) and "tp=8 tp_mode=2.5d
tp_depth=2" (q=2, d=2), every rank's block of each kernel's output and of the gradients of its
input, weight and bias equals the same block of one process's torch computation (fp32: 1e-5
relative L2; bf16 inputs: 2e-2 against the fp32 computation on the same bf16 values). Kernels:
``Linear2D`` in ``nn.Linear`` storage with a bias and in ``Conv1D`` storage with a fused
[q|k|v] output; ``LayerNorm2D``; ``RMSNorm2D`` (transformers' LlamaRMSNorm); ``Embedding2D``;
an untied ``LMHead2D`` with a bias, and the tied one with ``grid_cross_entropy``, on an odd
vocabulary (11, padded to 12) with ignored targets (a whole row block of them under 2.5D);
``scatter_hidden`` / ``gather_hidden`` both ways. Parameter gradients are placed through their
``ParamLayout`` and must tile the global tensor once per replica (d for weight blocks, d*q for
chunks j, which every row of a column holds). The bytes one ``Linear2D`` forward + backward
hands to ``Collectives`` per rank, by op and grid axis, equal ``linear.py``'s formula.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kernels_runtime.parallel.tensor.grid as grid_package

B, S, H, F, V = 4, 3, 8, 12, 11  # batch divides by d*q = 4; V odd: padded to 12 over q = 2
PLANS = {"2d": ("tp=4 tp_mode=2d", 4, 1), "2.5d": ("tp=8 tp_mode=2.5d tp_depth=2", 8, 2)}
Q = 2
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
PARAMS = ("w", "b", "qkv", "qkv_b", "ln_w", "ln_b", "rms_w", "emb", "tied", "head", "head_b")
COLUMN = ("b", "qkv_b", "ln_w", "ln_b", "rms_w", "head_b")  # chunk j: every row of column j


def _data(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Inputs, rounded to ``dtype`` (so the fp32 reference sees the same values)."""
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    ids = torch.randint(0, V, (B, S), generator=g)
    labels = ids.roll(1, -1).clone()
    labels[0] = -100  # a whole row block of ignored targets under 2.5D
    labels[2, 1] = -100
    return {"x": r(B, S, H) + 0.5, "w": r(F, H), "b": r(F), "qkv": r(H, 3 * H),
            "qkv_b": r(3 * H), "ln_w": 1 + r(H) / 4, "ln_b": r(H), "rms_w": 1 + r(H) / 4,
            "emb": r(V, H), "tied": r(V, H), "head": r(V, H), "head_b": r(V),
            "up_head": r(B, S, V), "up": r(B, S, F), "up_qkv": r(B, S, 3 * H),
            "up_ln": r(B, S, H), "up_rms": r(B, S, H), "up_emb": r(B, S, H), "ids": ids,
            "labels": labels}


def _reference() -> dict[str, torch.Tensor]:
    """The unsplit computation in fp32 (on bf16-rounded inputs for the bf16 runs)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    out = {}
    for name in TOL:
        d = {k: v.float().requires_grad_() if v.is_floating_point() else v
             for k, v in _data(getattr(torch, name)).items()}
        y = torch.nn.functional.linear(d["x"], d["w"], d["b"])
        qkv = d["x"] @ d["qkv"] + d["qkv_b"]  # Conv1D storage
        ln = torch.nn.functional.layer_norm(d["x"], (H,), d["ln_w"], d["ln_b"], 1e-5)
        rms_mod = LlamaRMSNorm(H, eps=1e-6)
        rms = torch.func.functional_call(rms_mod, {"weight": d["rms_w"]}, (d["x"],))
        emb = torch.nn.functional.embedding(d["ids"], d["emb"])
        logits = torch.tanh(torch.nn.functional.embedding(d["ids"], d["tied"])) @ d["tied"].t()
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, V), d["labels"].reshape(-1))
        head = torch.nn.functional.linear(d["x"], d["head"], d["head_b"])  # (b, s, V)
        terms = {"lin": (y * d["up"]).sum(), "qkv": (qkv * d["up_qkv"]).sum(),
                 "ln": (ln * d["up_ln"]).sum(), "rms": (rms * d["up_rms"]).sum(),
                 "head": (head * d["up_head"]).sum()}
        grad_x = {f"grad_x_{k}": torch.autograd.grad(t, d["x"], retain_graph=True)[0]
                  for k, t in terms.items()}  # each module's own share of dL/dx
        (sum(terms.values()) + (emb * d["up_emb"]).sum() + ce).backward()
        out[name] = {"y": y, "qkv": qkv, "head": head, "ln": ln, "rms": rms, "emb": emb,
                     "logits": logits, "ce": ce, "up": d["up"], **grad_x,
                     **{f"grad_{p}": d[p].grad for p in PARAMS}}
        out[name] = {k: v.detach() for k, v in out[name].items()}
    return out


def _placed(module: torch.nn.Module, name: str, key: str) -> list:
    grad = getattr(module, name).grad
    box = ((0,) * grad.dim(), tuple(grad.shape))
    return [(s.offsets, s.sizes, grad[where].detach().float())
            for s, where in module.layouts[name].shards(key, box)]


def _kernels(rank: int, world: int, plan: str, dtype_name: str) -> dict:
    from kernels_runtime.parallel.tensor.grid import (
        Embedding2D,
        Grid,
        LayerNorm2D,
        Linear2D,
        LMHead2D,
        RMSNorm2D,
        gather_hidden,
        grid_cross_entropy,
        scatter_hidden,
        scatter_ids,
        split_features,
    )

    from helpers.distributed import context

    ctx = context(plan)
    grid, d = Grid.of(ctx), _data(getattr(torch, dtype_name))
    out: dict = {"coords": (grid.k, grid.i, grid.j), "placed": {}}

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone().requires_grad_(True)

    x_full = leaf(d["x"])
    x_block = scatter_hidden(x_full, grid)  # (b/(d*q), s, h/q)
    up = {k: scatter_hidden(d[k], grid) for k in ("up", "up_ln", "up_rms", "up_emb")}
    up["up_qkv"] = torch.cat([scatter_hidden(p, grid) for p in d["up_qkv"].chunk(3, -1)], -1)

    # Linear2D, nn.Linear storage + bias: bytes of its forward + backward alone
    lin = Linear2D.from_full(d["w"], d["b"], grid)
    x_in = leaf(x_block)
    before = ctx.comm.stats.snapshot()
    y = lin(x_in)
    y.backward(up["up"])
    after = ctx.comm.stats.snapshot()
    out["bytes"] = {(op, g): after[op][g]["bytes"] - before.get(op, {}).get(g, {"bytes": 0})[
        "bytes"] for op in after for g in after[op]}
    out["bytes"] = {k: v for k, v in out["bytes"].items() if v}
    out.update(y=y.detach().float(), grad_x_lin=x_in.grad.float(),
               y_full=gather_hidden(y.detach(), grid).float())
    out["placed"].update(w=_placed(lin, "weight", "w"), b=_placed(lin, "bias", "b"))
    y_leaf = leaf(y)  # gather_hidden's backward keeps this rank's block
    (gather_hidden(y_leaf, grid) * d["up"]).sum().backward()  # the same loss on every rank
    out["gather_grad"] = y_leaf.grad.float()

    # Conv1D storage, fused [q|k|v]
    c_attn = Linear2D.from_full(d["qkv"], d["qkv_b"], grid, transposed=True, parts=3)
    x_in2 = leaf(x_block)
    qkv = c_attn(x_in2)
    (qkv * up["up_qkv"]).sum().backward()
    out.update(qkv=qkv.detach().float(), grad_x_qkv=x_in2.grad.float())
    out["placed"].update(qkv=_placed(c_attn, "weight", "qkv"),
                         qkv_b=_placed(c_attn, "bias", "qkv_b"))

    # norms
    (ln_w, l_ln_w), (ln_b, l_ln_b) = (split_features(d[k], grid) for k in ("ln_w", "ln_b"))
    rms_w, l_rms_w = split_features(d["rms_w"], grid)
    ln, rms = LayerNorm2D(ln_w, ln_b, grid, eps=1e-5), RMSNorm2D(rms_w, grid, eps=1e-6)
    ln.layouts, rms.layouts = {"weight": l_ln_w, "bias": l_ln_b}, {"weight": l_rms_w}
    x_ln, x_rms = leaf(x_block), leaf(x_block)
    y_ln, y_rms = ln(x_ln), rms(x_rms)
    ((y_ln * up["up_ln"]).sum() + (y_rms * up["up_rms"]).sum()).backward()
    out.update(ln=y_ln.detach().float(), rms=y_rms.detach().float(),
               grad_x_ln=x_ln.grad.float(), grad_x_rms=x_rms.grad.float())
    out["placed"].update(ln_w=_placed(ln, "weight", "ln_w"), ln_b=_placed(ln, "bias", "ln_b"),
                         rms_w=_placed(rms, "weight", "rms_w"))

    # an untied head (odd vocabulary, padded) with a bias
    head_u = LMHead2D.untied(d["head"], grid, d["head_b"])
    x_head = leaf(x_block)
    up_head = scatter_hidden(torch.nn.functional.pad(d["up_head"], (0, -V % Q)), grid)
    lg = head_u(x_head)  # (b/(d*q), s, ceil(V/q))
    (lg * up_head).sum().backward()
    out.update(head=lg.detach().float(), grad_x_head=x_head.grad.float())
    out["placed"].update(head=_placed(head_u, "weight", "head"),
                         head_b=_placed(head_u, "bias", "head_b"))

    # embedding alone, then tied head + cross-entropy
    ids = scatter_ids(d["ids"], grid)  # (b/(d*q), s)
    emb = Embedding2D.from_full(d["emb"], grid)
    e = emb(ids)
    (e * up["up_emb"]).sum().backward()
    tied = Embedding2D.from_full(d["tied"], grid)
    head = LMHead2D.tied(tied)
    logits = head(torch.tanh(tied(ids)))  # (b/(d*q), s, ceil(V/q))
    ce = grid_cross_entropy(logits, scatter_ids(d["labels"], grid), grid, V)
    ce.backward()
    out.update(emb=e.detach().float(), logits=logits.detach().float(), ce=ce.detach().float(),
               tied_shared=head.weight is tied.weight,
               logits_full=gather_hidden(logits.detach(), grid, width=V).float())
    out["placed"].update(emb=_placed(emb, "weight", "emb"), tied=_placed(tied, "weight", "tied"))
    # the grad of x_full: scatter_hidden's backward all-gathers every block's gradient
    x_block.backward(x_in.grad)
    out["grad_x_full"] = x_full.grad.float()
    return out


def _block(full: torch.Tensor, k: int, i: int, j: int, d: int, parts: int = 1) -> torch.Tensor:
    """Rank (k, i, j)'s block of a full (b, s, features) tensor (chunk j of each part)."""
    rows = full.chunk(d * Q, 0)[k * Q + i]
    return torch.cat([p.chunk(Q, -1)[j] for p in rows.chunk(parts, -1)], -1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _check(results: list[dict], ref: dict, d: int, tol: float) -> None:
    for r in results:
        k, i, j = r["coords"]
        blocks = {"y": _block(ref["y"], k, i, j, d), "qkv": _block(ref["qkv"], k, i, j, d, 3),
                  "ln": _block(ref["ln"], k, i, j, d), "rms": _block(ref["rms"], k, i, j, d),
                  "emb": _block(ref["emb"], k, i, j, d),
                  **{f"grad_x_{m}": _block(ref[f"grad_x_{m}"], k, i, j, d)
                     for m in ("lin", "qkv", "ln", "rms", "head")}}
        for name in ("logits", "head"):  # vocabulary padded to a multiple of q with zeros
            padded = torch.nn.functional.pad(ref[name], (0, Q * r[name].shape[-1] - V))
            blocks[name] = _block(padded, k, i, j, d)
        for name, want in blocks.items():
            assert _rel(r[name], want) <= tol, (name, r["coords"], _rel(r[name], want))
        assert _rel(r["gather_grad"], _block(ref["up"], k, i, j, d)) <= tol
        assert _rel(r["y_full"], ref["y"]) <= tol
        assert _rel(r["logits_full"], ref["logits"]) <= tol  # padding dropped
        assert _rel(r["ce"], ref["ce"]) <= tol, (float(r["ce"]), float(ref["ce"]))
        assert _rel(r["grad_x_full"], ref["grad_x_lin"]) <= tol
        assert r["tied_shared"]
    for name in PARAMS:
        want = ref[f"grad_{name}"]
        covered = torch.zeros(want.shape, dtype=torch.int64)
        for r in results:
            for offsets, sizes, grad in r["placed"][name]:
                where = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                covered[where] += 1
                assert _rel(grad, want[where]) <= tol, (name, r["coords"], _rel(grad, want[where]))
        copies = d * Q if name in COLUMN else d  # replicas: depths (and rows, for chunks j)
        assert bool((covered == copies).all()), f"{name}: blocks do not tile it {copies} times"


@pytest.fixture(scope="module")
def reference() -> dict:
    return _reference()


def _linear_bytes(d: int, e: int) -> dict[tuple[str, str], int]:
    """linear.py's formula for one Linear2D(H -> F, bias) forward + backward, per rank, with
    n = B*S/(d*q) tokens per rank and e bytes per element."""
    n, m, o, q = B * S // (d * Q), H, F, Q
    out = {("broadcast", "tp_row"): 2 * n * m * e, ("broadcast", "tp_col"): 2 * m * o * e // q,
           ("reduce_scatter", "tp_row"): n * m * e,
           ("reduce_scatter", "tp_col"): m * o * e // q, ("all_reduce", "tp_col"): o * e // q}
    if d > 1:
        out[("all_reduce", "tp_dep")] = (m * o // (q * q) + o // q) * e
    return out


@pytest.mark.parametrize("mode", [pytest.param("2d", marks=pytest.mark.slow),
                                  pytest.param("2.5d", marks=pytest.mark.full)])
@pytest.mark.parametrize("dtype_name", ["float32",
                                        pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_grid_kernels_match_one_process(ranks, reference, mode, dtype_name):
    plan, world, d = PLANS[mode]
    results = ranks(world).run(_kernels, plan, dtype_name, timeout_s=120)
    _check(results, reference[dtype_name], d, TOL[dtype_name])
    e = getattr(torch, dtype_name).itemsize
    for r in results:  # what one Linear2D forward + backward handed to the collectives
        assert r["bytes"] == _linear_bytes(d, e), (r["coords"], r["bytes"])


def test_grid_kernels_never_sync_the_host():
    """Forward and backward must not wait on the device (no .item(), .tolist(), .cpu())."""
    calls = (".item()", ".tolist()", ".cpu()", ".numpy()")
    found = [f"{path.name}:{n}: {line.strip()}"
             for path in sorted(Path(grid_package.__file__).parent.glob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), start=1)
             if any(c in line for c in calls)]
    assert not found, "\n".join(found)

"""``ep`` on MoE blocks whose experts are a ModuleList behind a router ``nn.Linear`` (issue 29, 3).

What is protected: the module-list reader (``policies/moe_modulelist.py``) recognizes the two
styles users bring, written here as transformers 4 wrote them: Mixtral's (``w1/w3/w2`` experts,
top-2 renormalized, the block returning (hidden, router logits)) and Qwen2-MoE's
(``gate_proj/up_proj/down_proj`` experts, top-2 not renormalized, a shared expert scaled by
``sigmoid(shared_expert_gate)``, the block returning hidden states only); its single-process
reading equals each block's output (1e-6), the probe leaves the global RNG alone, and blocks it
cannot read (experts with biases, of different shapes, no top-k attribute, routing other than
softmax/top-k) are refused with what it expects; a dense MLP is not a candidate. On real gloo
ranks (slow tier) a tiny hand-written LM of such blocks, parallelized by
``parallelize(model, opt, "ep=...")``, gives the single-process model's 5 SGD steps (loss,
with the load-balancing loss over the dp batch where the block returns its logits; every
parameter's gradient each step under zero 0, the clipping norm, and every parameter after
each step), all within 1e-5 relative L2, under ep=2, dp=4 ep=2 zero=1 (expert-dp 2) and ep=2
zero=3 with a first batch that leaves one rank's experts without a token. The ep=2 model keeps
the plain model's parameter names (a rank holds its experts under their global indices), and
its checkpoint loads into one plain process with the same logits (1e-6) and back under ep=2.
Refusals through ``parallelize``: an ep that does not divide the experts, experts with biases,
and tp beside module-list experts; the engine's plan check refuses ep on them (it splits fused
experts only) and leaves other plans to the model's policy.
"""

from __future__ import annotations

import pytest
import torch
from test_expert_parallelize import _assert_close, _compare, _rel
from torch import nn

BATCH, SEQ, HIDDEN, INTER, VOCAB, EXPERTS = 8, 8, 16, 32, 32, 4
STEPS, LR, AUX_COEF = 5, 0.5, 0.1


class SwiGLU(nn.Module):
    """transformers 4 Mixtral's expert."""

    def __init__(self, inter: int = INTER, bias: bool = False) -> None:
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, inter, bias=bias)
        self.w2 = nn.Linear(inter, HIDDEN, bias=bias)
        self.w3 = nn.Linear(HIDDEN, inter, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class GatedMLP(nn.Module):
    """transformers 4 Qwen2-MoE's expert (and shared expert)."""

    def __init__(self, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, inter, bias=False)
        self.up_proj = nn.Linear(HIDDEN, inter, bias=False)
        self.down_proj = nn.Linear(inter, HIDDEN, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MixtralStyleMoe(nn.Module):
    """transformers 4's MixtralSparseMoeBlock: softmax, top-2, renormalized; (hidden, logits)."""

    def __init__(self, experts: list[nn.Module] | None = None, routing: str = "softmax") -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList(experts or [SwiGLU() for _ in range(EXPERTS)])
        self.top_k, self.routing = 2, routing

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, h = x.shape
        flat = x.view(-1, h)  # (t, h)
        logits = self.gate(flat)  # (t, E)
        scores = torch.sigmoid(logits) if self.routing == "sigmoid" else \
            torch.softmax(logits, dim=1, dtype=torch.float)
        weights, chosen = torch.topk(scores, self.top_k, dim=-1)  # (t, k)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(flat)
        mask = nn.functional.one_hot(chosen, len(self.experts)).permute(2, 1, 0)  # (E, k, t)
        for index, expert in enumerate(self.experts):
            slot, token = torch.where(mask[index])
            out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.view(b, s, h), logits


class QwenStyleMoe(nn.Module):
    """transformers 4's Qwen2MoeSparseMoeBlock: top-2 not renormalized, a gated shared expert."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts_per_tok, self.norm_topk_prob = 2, False
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList([GatedMLP(24) for _ in range(EXPERTS)])
        self.shared_expert = GatedMLP(40)
        self.shared_expert_gate = nn.Linear(HIDDEN, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.view(-1, h)  # (t, h)
        weights = torch.softmax(self.gate(flat), dim=1, dtype=torch.float)  # (t, E)
        weights, chosen = torch.topk(weights, self.num_experts_per_tok, dim=-1)  # (t, k)
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == index)
            out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return (out + shared).view(b, s, h)


class Layer(nn.Module):
    def __init__(self, style: str) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN)
        self.moe = MixtralStyleMoe() if style == "mixtral" else QwenStyleMoe()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self.mix(self.norm1(x))
        out = self.moe(self.norm2(x))
        out, logits = out if isinstance(out, tuple) else (out, None)
        return x + out, logits


class TinyMoeLM(nn.Module):
    """Embedding, 2 layers of (token mixer, module-list MoE), head: (b, s) -> (b, s, V)."""

    def __init__(self, style: str, seed: int = 0) -> None:
        torch.manual_seed(seed)
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Layer(style) for _ in range(2)])
        self.norm, self.head = nn.RMSNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        x, router_logits = self.embed(ids), []
        for layer in self.layers:
            x, logits = layer(x)
            if logits is not None:
                router_logits.append(logits)
        return self.head(self.norm(x)), tuple(router_logits)


# ---- the reader, in one process (fast tier) -------------------------------------------------

def test_reader_reads_both_styles_as_the_blocks_compute():
    from kernels_runtime.policies.moe_modulelist import read_forward, read_modulelist_block

    x = torch.randn(3, 5, HIDDEN, generator=torch.Generator().manual_seed(1))
    for style, linears, normalize, logits, shared in (
            ("mixtral", ("w1", "w3", "w2"), True, True, None),
            ("qwen", ("gate_proj", "up_proj", "down_proj"), False, False, "shared_expert")):
        block = TinyMoeLM(style).layers[0].moe
        rng = torch.get_rng_state()
        reading = read_modulelist_block(block)
        assert torch.equal(rng, torch.get_rng_state()), "the probe used the global RNG"
        assert (reading.linears, reading.normalize, reading.returns_logits,
                reading.shared_expert, reading.num_experts, reading.top_k) == \
            (linears, normalize, logits, shared, EXPERTS, 2), reading
        out = block(x)
        expected = out[0] if logits else out
        assert _rel(read_forward(block, reading, x)[0], expected) < 1e-6
    assert read_modulelist_block(GatedMLP(INTER)) is None  # a dense MLP is no candidate


@pytest.mark.parametrize("block, says", [
    (lambda: MixtralStyleMoe([SwiGLU(bias=True) for _ in range(EXPERTS)]),
     r"parameters \['w1.bias', 'w2.bias', 'w3.bias'\] besides their weights"),
    (lambda: MixtralStyleMoe([SwiGLU(INTER if i else 8) for i in range(EXPERTS)]),
     "its experts differ in shapes"),
    (lambda: MixtralStyleMoe(routing="sigmoid"), "differs from softmax/top-2 routing"),
], ids=["biases", "shapes", "sigmoid-routing"])
def test_reader_refuses_what_it_cannot_read(block, says):
    from kernels_runtime.policies.moe_modulelist import ModuleListError, read_modulelist_block

    with pytest.raises(ModuleListError, match=says) as refused:
        read_modulelist_block(block())
    assert "expects a router nn.Linear(h, E) and an nn.ModuleList of E experts" in \
        str(refused.value)


def test_reader_asks_for_a_top_k():
    from kernels_runtime.policies.moe_modulelist import ModuleListError, read_modulelist_block

    block = MixtralStyleMoe()
    del block.top_k
    block.forward = lambda x: x  # never reached: refused before the probe
    with pytest.raises(ModuleListError, match="attribute top_k or num_experts_per_tok"):
        read_modulelist_block(block)


def test_engine_says_it_serves_modulelist_experts_whole():
    """The engine splits fused experts only: ep on module-list experts is refused with what to
    use instead; a plan without ep is not the experts' concern (the model's policy decides)."""
    from kernels_runtime.inference.moe_plans import moe_problem
    from kernels_runtime.inference.plans import inference_plan

    why = moe_problem(TinyMoeLM("mixtral"), inference_plan("ep=2").validate(2))
    assert "keeps its experts in an nn.ModuleList" in why and "use ep=1" in why
    assert moe_problem(TinyMoeLM("mixtral"), inference_plan("tp=2").validate(2)) is None


# ---- parity on gloo ranks (slow tier) -------------------------------------------------------

def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    return ids, ids[:, 1:]  # (b, s), (b, s-1) next tokens


def _loss(model, ids, labels, tokens: int, aux) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(summed next-token loss over the global token count, aux loss or 0, router logits)."""
    logits, router_logits = model(ids)
    lm = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels.reshape(-1),
                                     reduction="sum") / tokens
    return lm, aux(router_logits) if router_logits else torch.zeros(()), router_logits


def _idle_one_rank(*models: nn.Module) -> None:
    """Every MoE input zero: the router logits tie and top-2 picks the same two experts
    (torch's top-k on ties: 2 and 3 today) for every token, both on one ep rank."""
    with torch.no_grad():
        for model in models:
            for layer in model.layers:
                layer.norm2.weight.zero_()


def _train_on_rank(rank: int, world: int, style: str, plan: str,
                   idle: bool = False) -> dict[str, float]:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from kernels_runtime import parallelize
    from kernels_runtime.parallel.expert import load_balancing_loss

    from helpers.distributed import context

    ctx = context(plan)
    dp = ctx.dp_size
    share = slice(ctx.dp_rank * BATCH // dp, (ctx.dp_rank + 1) * BATCH // dp)
    reference, model = TinyMoeLM(style), TinyMoeLM(style)
    if idle:
        _idle_one_rank(reference, model)
    names = {n for n, _ in model.named_parameters()}
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=LR), ctx=ctx,
                             verbose=False)
    errors = _swapped(model, ctx, names)

    def ref_aux(logits: tuple) -> torch.Tensor:
        return load_balancing_loss_func(logits, EXPERTS, 2)

    def aux_of(logits: tuple) -> torch.Tensor:  # HF's loss of the batch joined over dp
        return load_balancing_loss(logits, EXPERTS, 2, None, ctx.comm, ctx.dp_group)

    for step in range(STEPS):
        ids, labels = _batch(step)
        tokens = labels.numel()
        lm, aux, _ = _loss(reference, ids, labels, tokens, ref_aux)
        ref_opt.zero_grad()
        (lm + AUX_COEF * aux).backward()
        my_lm, my_aux, router_logits = _loss(model, ids[share], labels[share], tokens, aux_of)
        opt.zero_grad()
        opt.backward(dp * (my_lm + AUX_COEF * my_aux))  # dp averages: each share times dp
        opt.finish_grad_sync()
        total = my_lm.detach().clone()
        ctx.comm.all_reduce(total, group=ctx.dp_group)
        errors[f"loss step {step}"] = _rel(total + AUX_COEF * my_aux.detach(),
                                           lm + AUX_COEF * aux)
        if idle and step == 0:  # the case is what it claims, on every rank
            picked = {int(e) for lg in router_logits for e in lg.topk(2).indices.reshape(-1)}
            errors["both ranks' experts got tokens"] = float(picked not in ({0, 1}, {2, 3}))
        ref_norm = torch.cat([p.grad.reshape(-1) for p in reference.parameters()]).norm()
        errors[f"grad norm step {step}"] = _rel(torch.tensor(opt.global_grad_norm(
            opt.sync.master_grads())), ref_norm)
        if ctx.plan.zero_stage == 0:  # zero 1-3 keep reduced shards only
            errors.update(_compare(model, reference, f"grad step {step}", grads=True))
        ref_opt.step()
        opt.step()
        errors.update(_compare(model, reference, f"param step {step}", grads=False))
    return errors


def _swapped(model: nn.Module, ctx, names: set[str]) -> dict[str, float]:
    """The case is what it claims (1.0 where not): both blocks swapped, this rank holding the
    experts of its ep place under their global indices, and every name the plain model's
    (the other ranks' experts held elsewhere)."""
    from kernels_runtime.parallel.expert.modulelist_layer import ModuleListLocalExperts

    local = [m for m in model.modules() if isinstance(m, ModuleListLocalExperts)]
    per = EXPERTS // ctx.plan.ep
    first = ctx.dp_rank % ctx.plan.ep * per
    held = [sorted(int(n) for n, _ in m.named_children()) for m in local]
    mine = {n for n, _ in model.named_parameters()}
    return {"blocks not swapped": float(len(local) != 2),
            "not this rank's experts": float(held != [list(range(first, first + per))] * 2),
            "names not the plain model's": float(
                not mine < names or mine | model.parallel_state.elsewhere != names)}


CASES = [("mixtral", 2, "ep=2", False), ("qwen", 4, "dp=4 ep=2 zero=1", False),
         ("mixtral", 2, "ep=2 zero=3", True)]


@pytest.mark.slow
@pytest.mark.parametrize("style, world, plan, idle", CASES,
                         ids=[f"{s}-{w}ranks-{p.replace(' ', '-')}" for s, w, p, _ in CASES])
def test_modulelist_experts_train_like_one_process(ranks, style, world, plan, idle):
    _assert_close(ranks(world).run(_train_on_rank, style, plan, idle, timeout_s=120))


def _checkpoint_on_rank(rank: int, world: int, root: str) -> dict[str, float]:
    """Save an ep=2 model (one SGD step taken); rank 0 loads it into a plain model in one
    process, and every rank loads it back under ep=2 into other weights: same logits."""
    from pathlib import Path

    from kernels_runtime import parallelize, parallelize_model
    from kernels_runtime.checkpoint import load_model, save

    from helpers.distributed import context

    ctx = context("ep=2")
    ids, labels = _batch(0)
    model = TinyMoeLM("mixtral")
    model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=LR), ctx=ctx,
                             verbose=False)
    share = ids[rank::world]
    opt.zero_grad()
    opt.backward(_loss(model, share, labels[rank::world], labels.numel(),
                       lambda _: torch.zeros(()))[0])
    opt.finish_grad_sync()
    opt.step()
    save(Path(root), model, opt, step=1)
    with torch.no_grad():
        saved = model(ids)[0]  # (b, s, V): every rank runs the whole batch
        other = parallelize_model(TinyMoeLM("mixtral", seed=1), ctx=ctx, verbose=False)
        errors = {"before loading": _rel(other(ids)[0], saved)}
        load_model(Path(root), other)
        errors["loaded back under ep=2"] = _rel(other(ids)[0], saved)
        if rank == 0:
            plain = TinyMoeLM("mixtral", seed=2)
            load_model(Path(root), plain)
            errors["plain model in one process"] = _rel(plain(ids)[0], saved)
    return errors


@pytest.mark.slow
def test_modulelist_checkpoint_loads_into_one_plain_process(ranks, tmp_path):
    """The checkpoint holds the plain model's names (each expert written by its ep place)."""
    results = ranks(2).run(_checkpoint_on_rank, str(tmp_path / "ckpt"), timeout_s=120)
    assert all(r.pop("before loading") > 0.1 for r in results)  # other weights, other logits
    assert "plain model in one process" in results[0]
    bad = {what: err for r in results for what, err in r.items() if not err <= 1e-6}
    assert not bad, f"logits off by more than 1e-6 relative L2: {bad}"


def _refusals_on_rank(rank: int, world: int) -> list[str]:
    from kernels_runtime import parallelize_model
    from kernels_runtime.mesh.plan import PlanError

    from helpers.distributed import context

    three = TinyMoeLM("mixtral")
    for layer in three.layers:  # 3 experts: router and list cut to match
        layer.moe.experts = layer.moe.experts[:3]
        layer.moe.gate = nn.Linear(HIDDEN, 3, bias=False)
    biased = TinyMoeLM("mixtral")
    for layer in biased.layers:
        layer.moe.experts = nn.ModuleList([SwiGLU(bias=True) for _ in range(EXPERTS)])
    messages = []
    for model, plan in ((three, "ep=2"), (biased, "ep=2"), (TinyMoeLM("mixtral"), "ep=2 tp=2")):
        with pytest.raises(PlanError) as refused:
            parallelize_model(model, ctx=context(plan), verbose=False)
        messages.append(str(refused.value))
    return messages


@pytest.mark.slow
def test_parallelize_explains_modulelist_experts_it_cannot_split(ranks):
    three, biased, with_tp = ranks(4).run(_refusals_on_rank, timeout_s=120)[0]
    assert "ep=2 does not divide the 3 experts of layers.0.moe" in three
    assert "choose ep in [1, 3]" in three
    assert "besides their weights (biases or other parts)" in biased
    assert "expects a router nn.Linear(h, E)" in biased
    assert "available with dp and zero 0-3 only" in with_tp and "use tp=1" in with_tp

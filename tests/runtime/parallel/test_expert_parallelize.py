"""``ep`` as a plan axis: ``parallelize`` splits the experts and trains like one process.

What is protected (issue 29, step 2): a tiny Mixtral (4 experts, top-2, 2 layers), a tiny
Qwen2-MoE (4 experts, top-2, a gated shared expert) and, in the full tier, a tiny Qwen3-MoE
(top-k renormalized, no shared expert) parallelized by ``parallelize(model, opt,
"ep=...")`` on real gloo ranks give, on a padded batch split over dp, the single-process
model's 5 SGD steps: losses (language-model loss plus the router's load-balancing loss as HF
computes it on the whole batch, ``load_balancing_loss``), first-step gradients of every
parameter (expert slices where they live) and the global gradient norm clipping uses, and the
final parameters, all within 1e-5 relative L2.
ep=2 on 2 ranks runs in the fast tier, with a batch routed so one ep rank's experts get no
token under zero 2 and 3 (no hang, right gradients); ep=2 (dp=4, expert-dp 2) and ep=4 on 4
ranks, and ep=2 under zero 1, 2 and 3, in the full tier. Refusals: an ep that does not divide
dp or the experts, and ep on a dense model, each say what to choose instead.
"""

from __future__ import annotations

import pytest
import torch

BATCH, SEQ, HIDDEN, VOCAB, EXPERTS = 8, 8, 32, 64, 4
STEPS, LR, AUX_COEF, TOL = 5, 0.5, 0.1, 1e-5
MASK = torch.ones(BATCH, SEQ, dtype=torch.long)
MASK[1, 5:] = 0  # padded rows in every rank's share
MASK[3, 2:] = 0
MASK[6, 4:] = 0


def _model(family: str, experts: int = EXPERTS) -> torch.nn.Module:
    import transformers

    common = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, vocab_size=VOCAB,
                  max_position_embeddings=SEQ, initializer_range=0.2,
                  router_aux_loss_coef=AUX_COEF)
    torch.manual_seed(0)
    if family == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=64, num_local_experts=experts, **common))
    if family == "qwen3_moe":  # no shared expert, top-k renormalized
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=64, moe_intermediate_size=32, num_experts=experts, head_dim=8,
            decoder_sparse_step=1, norm_topk_prob=True, **common))
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=experts, decoder_sparse_step=1, norm_topk_prob=False, **common))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    return ids, ids.masked_fill(MASK == 0, -100)[:, 1:]  # (b, s), (b, s-1) next tokens


def _lm_loss(out, labels: torch.Tensor, tokens: int) -> torch.Tensor:
    """This share's summed next-token loss over the global count of real tokens."""
    return torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB),
                                             labels.reshape(-1), reduction="sum") / tokens


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().float(), expected.detach().float()
    return float((actual - expected).norm() / max(float(expected.norm()), 1e-6))


def _compare(model, reference, what: str, grads: bool) -> dict[str, float]:
    """Every parameter (or its gradient) against the reference; an expert slice against the
    reference's experts [first, first + E/ep)."""
    from kernels_runtime.parallel.expert import is_expert_parameter

    ref = dict(reference.named_parameters())
    errors = {}
    for name, param in model.named_parameters():
        mine, full = (param.grad, ref[name].grad) if grads else (param, ref[name])
        assert mine is not None, f"{name} has no gradient"
        if hasattr(mine, "full_tensor"):  # zero=3: a DTensor shard (experts: over expert-dp)
            mine = mine.full_tensor()
        if is_expert_parameter(param):
            first = model.get_submodule(name.rsplit(".", 1)[0]).first
            full = full[first:first + param.shape[0]]
        errors[f"{what} {name}"] = _rel(mine, full)
    return errors


def _idle_one_rank(*models: torch.nn.Module) -> None:
    """Zero every MoE input (the norm before it): all router logits tie and top-2 picks the
    same two experts for every token (torch's top-k on ties: 2 and 3 today), both on one ep
    rank, so the other rank's experts get no token on the first step."""
    with torch.no_grad():
        for model in models:
            for layer in model.model.layers:
                layer.post_attention_layernorm.weight.zero_()


def _picked(router_logits: tuple[torch.Tensor, ...]) -> set[int]:
    return {int(e) for logits in router_logits for e in logits.topk(2).indices.reshape(-1)}


def _train_on_rank(rank: int, world: int, family: str, plan: str, steps: int = STEPS,
                   idle: bool = False) -> dict[str, float]:
    from kernels_runtime import parallelize
    from kernels_runtime.parallel.expert.aux_loss import load_balancing_loss

    from helpers.distributed import context

    ctx = context(plan)
    dp, share = ctx.dp_size, slice(ctx.dp_rank * BATCH // ctx.dp_size,
                                   (ctx.dp_rank + 1) * BATCH // ctx.dp_size)
    reference, model = _model(family), _model(family)
    if idle:
        _idle_one_rank(reference, model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=LR), ctx=ctx,
                             verbose=False)
    swapped = sum("ExpertParallelMoE" in what for _, what in model.parallel_state.replaced)
    errors: dict[str, float] = {"blocks not swapped": float(swapped != 2)}
    for step in range(steps):
        ids, labels = _batch(step)
        tokens = int((labels != -100).sum())
        ref_out = reference(input_ids=ids, attention_mask=MASK, output_router_logits=True)
        ref_loss = _lm_loss(ref_out, labels, tokens) + AUX_COEF * ref_out.aux_loss
        ref_opt.zero_grad()
        ref_loss.backward()

        out = model(input_ids=ids[share], attention_mask=MASK[share], output_router_logits=True)
        lm = _lm_loss(out, labels[share], tokens)
        aux = load_balancing_loss(out.router_logits, EXPERTS, 2, MASK[share], ctx.comm,
                                  ctx.dp_group)
        opt.zero_grad()
        opt.backward(dp * (lm + AUX_COEF * aux))  # dp averages: each rank's share times dp
        opt.finish_grad_sync()
        total = lm.detach().clone()
        ctx.comm.all_reduce(total, group=ctx.dp_group)
        errors[f"loss step {step}"] = _rel(total + AUX_COEF * aux.detach(), ref_loss)
        errors[f"aux loss step {step}"] = _rel(aux, ref_out.aux_loss)
        if idle and step == 0:  # the case is what it claims, on every rank
            picked = _picked(out.router_logits)
            errors["both ranks' experts got tokens"] = float(picked not in ({0, 1}, {2, 3}))
        if step == 0:  # the clipping norm counts every expert once, whatever the zero stage
            ref_norm = torch.cat([p.grad.reshape(-1) for p in reference.parameters()]).norm()
            errors["grad norm"] = _rel(torch.tensor(opt.global_grad_norm(
                opt.sync.master_grads())), ref_norm)
        if step == 0 and ctx.plan.zero_stage == 0:  # zero 1/2 keep reduced shards only
            errors.update(_compare(model, reference, "grad", grads=True))
        ref_opt.step()
        opt.step()
    errors.update(_compare(model, reference, "param", grads=False))
    return errors


def _assert_close(results: list[dict[str, float]]) -> None:
    for rank, errors in enumerate(results):
        bad = {name: err for name, err in errors.items() if not err <= TOL}
        assert not bad, f"rank {rank}: relative L2 errors above {TOL}: {bad}"


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_ep2_trains_like_one_process(ranks, family):
    _assert_close(ranks(2).run(_train_on_rank, family, "ep=2", timeout_s=180))


FULL = [("mixtral", 4, "ep=2"), ("qwen2_moe", 4, "ep=2"), ("mixtral", 4, "ep=4"),
        ("qwen2_moe", 4, "ep=4"), ("mixtral", 2, "ep=2 zero=1"), ("qwen2_moe", 2, "ep=2 zero=2"),
        ("mixtral", 2, "ep=2 zero=3"), ("qwen2_moe", 4, "ep=2 zero=3"), ("qwen3_moe", 2, "ep=2"),
        ("qwen3_moe", 4, "ep=4 zero=1")]


@pytest.mark.full
@pytest.mark.parametrize("family, world, plan", FULL,
                         ids=[f"{f}-{w}ranks-{p.replace(' ', '-')}" for f, w, p in FULL])
def test_ep_plans_train_like_one_process(ranks, family, world, plan):
    _assert_close(ranks(world).run(_train_on_rank, family, plan, timeout_s=300))


@pytest.mark.parametrize("plan", ["ep=2 zero=3", "ep=2 zero=2"])
def test_an_expert_rank_without_tokens_still_steps(ranks, plan):
    """DeepSpeed #4808: under ZeRO-3 a rank whose experts got no token skipped their
    collectives and the others hung. Here every local expert runs (on zero rows) as one unit:
    the step completes with the single-process gradients. A hang would raise the ranks'
    30 s collective timeout; the run itself is bounded at 60 s."""
    _assert_close(ranks(2).run(_train_on_rank, "mixtral", plan, 2, True, timeout_s=60))


def test_plan_explains_an_ep_that_does_not_fit():
    from kernels_runtime.mesh.plan import Plan, PlanError

    assert Plan.parse("ep=2").validate(4).to_string() == "dp=4 ep=2"
    with pytest.raises(PlanError, match=r"ep=3 does not divide dp=4.*choose ep in \[1, 2, 4\]"):
        Plan.parse("ep=3").validate(4)
    with pytest.raises(PlanError, match=r"4 experts.*choose ep in \[1, 2, 4\]"):
        Plan.parse("ep=8").validate(8, {"num_local_experts": 4})


def _refusals_on_rank(rank: int, world: int) -> list[str]:
    """parallelize refuses ep on a dense model and on experts ep does not divide."""
    import transformers

    from kernels_runtime import parallelize_model
    from kernels_runtime.mesh.plan import PlanError

    from helpers.distributed import context

    ctx = context("ep=2")
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        vocab_size=VOCAB))
    messages = []
    for model in (dense, _model("mixtral", experts=3)):
        with pytest.raises(PlanError) as refused:
            parallelize_model(model, ctx=ctx, verbose=False)
        messages.append(str(refused.value))
    return messages


def test_parallelize_explains_ep_on_a_model_it_does_not_fit(ranks):
    dense, three = ranks(2).run(_refusals_on_rank, timeout_s=120)[0]
    assert "LlamaForCausalLM has none" in dense and "use ep=1 for a dense model" in dense
    assert "ep=2 does not divide the 3 experts of model.layers.0.mlp" in three
    assert "choose ep in [1, 3]" in three

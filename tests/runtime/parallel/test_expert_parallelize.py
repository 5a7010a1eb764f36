"""``ep`` as a plan axis: ``parallelize`` splits the experts and trains like one process.

What is protected (issue 29, step 2): a tiny Mixtral (4 experts, top-2, 2 layers), a tiny
Qwen2-MoE (4 experts, top-2, a gated shared expert) and, in the full tier, a tiny Qwen3-MoE
(top-k renormalized, no shared expert) parallelized by ``parallelize(model, opt,
"ep=...")`` on real gloo ranks give, on a padded batch split over dp, the single-process
model's 5 SGD steps: losses (language-model loss plus the router's load-balancing loss as HF
computes it on the whole batch, ``load_balancing_loss``), first-step gradients of every
parameter (the part of it this rank holds: expert slice, tp shard or both) and the global
gradient norm clipping uses, and the final parameters, held and as a checkpoint writes them
(every rank's pieces placed through their layouts), all within 1e-5 relative L2.
ep=2 on 2 ranks runs in the fast tier, with a batch routed so one ep rank's experts get no
token under zero 2 and 3 (no hang, right gradients); ep=2 (dp=4, expert-dp 2) and ep=4 on 4
ranks, ep=2 under zero 1, 2 and 3 and with ckpt, and ep=2 beside tp=2 (attention and shared
expert tensor-parallel, each expert split over tp too) in the full tier, as are ep=2 in pp=2
stages (1F1B, with ckpt, zbv on 4 layers, and with tp=2 on 8 ranks): there each global
micro-batch is one HF forward of the reference, its auxiliary loss HF's, reached through the
router sums the stages carry (``stage_aux_loss``). Refusals: an ep that does not divide dp
or the experts, ep on a dense model, and ep beside what it does not compose with yet
(sp_mode, a tp grid), each say what to choose instead.
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


def _model(family: str, experts: int = EXPERTS, layers: int = 2) -> torch.nn.Module:
    import transformers

    common = dict(hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4,
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


def _local_part(full: torch.Tensor, layout, shape: torch.Size) -> torch.Tensor:
    """The part of a reference tensor a rank holds, through its layout's blocks (an expert
    slice, a tp shard, both, or the whole tensor)."""
    if layout is None:
        return full
    out = full.new_zeros(shape)
    for local, start, sizes in layout.blocks:
        out[tuple(slice(o, o + n) for o, n in zip(local, sizes))] = \
            full[tuple(slice(o, o + n) for o, n in zip(start, sizes))]
    return out


def _compare(model, reference, what: str, grads: bool) -> dict[str, float]:
    """Every parameter (or its gradient) against the reference's part this rank holds."""
    layouts = model.parallel_state.layouts
    ref = dict(reference.named_parameters())
    errors = {}
    for name, param in model.named_parameters():
        mine, full = (param.grad, ref[name].grad) if grads else (param, ref[name])
        assert mine is not None, f"{name} has no gradient"
        if hasattr(mine, "full_tensor"):  # zero=3: a DTensor shard (experts: over expert-dp)
            mine = mine.full_tensor()
        errors[f"{what} {name}"] = _rel(mine, _local_part(full, layouts.get(name), mine.shape))
    return errors


def _saved(model, reference) -> dict[str, float]:
    """Every full parameter as a checkpoint writes it (each rank's pieces placed through their
    layouts: expert, tp and pp boxes) against the reference."""
    from helpers.model_state import state_parameters

    full = state_parameters(model)
    return {f"saved {name}": _rel(full[name], param) if name in full else 1.0
            for name, param in reference.named_parameters()}


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


def _applied(model, plan) -> dict[str, float]:
    """The case is what it claims (1.0 where not): both blocks swapped (this stage's kept
    under pp), each expert split over tp under tp, the blocks checkpointed under ckpt."""
    from kernels_runtime.parallel.expert.moe_layer import LocalExperts

    state = model.parallel_state
    swapped = sum("ExpertParallelMoE" in what for _, what in state.replaced)
    local = [m for m in model.modules() if isinstance(m, LocalExperts)]
    layers = model.config.num_hidden_layers
    return {"blocks not swapped": float(swapped != layers or len(local) != layers // plan.pp),
            "experts not split over tp": float(any(m.tp != plan.tp for m in local)),
            "not checkpointed": float(plan.activation_checkpointing
                                      and "activation_checkpointing" not in state.applied)}


def _backward_both(model, opt, reference, ref_opt, ctx, share: slice, step: int,
                   errors: dict[str, float]):
    """Step ``step``'s batch through the one-process reference and, this rank's rows
    ``share`` of it, through the ranks' model, both backward (LM loss plus the aux loss, as
    HF computes it); the two losses' relative errors go into ``errors``. Returns the ranks'
    outputs (their router logits say which experts got tokens)."""
    from kernels_runtime.parallel.expert.aux_loss import load_balancing_loss

    dp = ctx.dp_size
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
    return out


def _train_on_rank(rank: int, world: int, family: str, plan: str, steps: int = STEPS,
                   idle: bool = False) -> dict[str, float]:
    from kernels_runtime import parallelize

    from helpers.distributed import context

    ctx = context(plan)
    share = slice(ctx.dp_rank * BATCH // ctx.dp_size, (ctx.dp_rank + 1) * BATCH // ctx.dp_size)
    reference, model = _model(family), _model(family)
    if idle:
        _idle_one_rank(reference, model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=LR), ctx=ctx,
                             verbose=False)
    errors = _applied(model, ctx.plan)
    for step in range(steps):
        out = _backward_both(model, opt, reference, ref_opt, ctx, share, step, errors)
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
    if ctx.plan.tp > 1:  # the tp boxes of the experts (ep alone: test_expert_checkpoint.py)
        errors.update(_saved(model, reference))
    return errors


def _train_pipelined_on_rank(rank: int, world: int, family: str, plan: str,
                             layers: int = 2) -> dict[str, float]:
    """``_train_on_rank`` through the pipeline's schedule (micro-batches of the dp share): the
    reference runs each global micro-batch (every dp rank's m-th) as one HF forward, so its
    auxiliary loss is HF's of that forward, which the last stage gets from the router sums
    every stage carried (``stage_aux_loss``)."""
    from kernels_runtime import parallelize
    from kernels_runtime.api.objective import Objective
    from kernels_runtime.parallel.expert import stage_aux_loss

    from helpers.distributed import context

    ctx = context(plan)
    dp, m = ctx.dp_size, ctx.plan.microbatches
    rows = BATCH // dp // m  # rows of one rank's micro-batch
    reference, model = _model(family, layers=layers), _model(family, layers=layers)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=LR), ctx=ctx,
                             verbose=False)
    errors = _applied(model, ctx.plan)
    for step in range(STEPS):
        ids, labels = _batch(step)
        globals_ = [[r * BATCH // dp + mb * rows + i for r in range(dp) for i in range(rows)]
                    for mb in range(m)]  # each global micro-batch's rows
        ref_opt.zero_grad()
        ref_total, ref_aux = 0.0, []
        for picked in globals_:
            tokens = int((labels[picked] != -100).sum())
            out = reference(input_ids=ids[picked], attention_mask=MASK[picked],
                            output_router_logits=True)
            loss = (_lm_loss(out, labels[picked], tokens) + AUX_COEF * out.aux_loss) / m
            loss.backward()
            ref_total += float(loss.detach())
            ref_aux.append(out.aux_loss.detach())
        mine = [picked[ctx.dp_rank * rows:(ctx.dp_rank + 1) * rows] for picked in globals_]
        seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (lm, aux) per micro-batch

        def loss_of(out, batch, seen=seen):
            tokens = int(batch["tokens"])
            lm = _lm_loss(out, batch["labels"], tokens)
            aux = stage_aux_loss(model)
            seen.append((lm.detach(), aux.detach()))
            return dp * (lm + AUX_COEF * aux)

        objective = Objective(  # the router sums come from the stages, not HF's recorder
            forward=lambda mdl, b: mdl(input_ids=b["input_ids"], attention_mask=b["mask"]),
            loss=loss_of)
        batches = [{"input_ids": ids[p], "mask": MASK[p], "labels": labels[p],
                    "tokens": (labels[g] != -100).sum()} for p, g in zip(mine, globals_)]
        opt.zero_grad()
        model.parallel_state.schedule.run(model, opt, batches, objective, ctx.telemetry)
        if seen:  # the rank of the last stage (zbv: the first pp rank)
            total = torch.zeros(())
            for index, (lm, aux) in enumerate(seen):
                ctx.comm.all_reduce(lm, group=ctx.dp_group)
                total += (lm + AUX_COEF * aux) / m
                errors[f"aux loss step {step} micro-batch {index}"] = _rel(aux, ref_aux[index])
            errors[f"loss step {step}"] = _rel(total, torch.tensor(ref_total))
        if step == 0:
            ref_norm = torch.cat([p.grad.reshape(-1) for p in reference.parameters()]).norm()
            errors["grad norm"] = _rel(torch.tensor(opt.global_grad_norm(
                opt.sync.master_grads())), ref_norm)
            if ctx.plan.zero_stage == 0:  # zero 1 keeps reduced shards only
                errors.update(_compare(model, reference, "grad", grads=True))
        ref_opt.step()
        opt.step()
    errors.update(_compare(model, reference, "param", grads=False))
    errors.update(_saved(model, reference))
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
        ("qwen3_moe", 4, "ep=4 zero=1"), ("mixtral", 4, "ep=2 tp=2"),
        ("qwen2_moe", 4, "ep=2 tp=2"), ("mixtral", 2, "ep=2 ckpt"),
        ("mixtral", 2, "ep=2 zero=2"), ("qwen2_moe", 2, "ep=2 zero=1")]


@pytest.mark.full
@pytest.mark.parametrize("family, world, plan", FULL,
                         ids=[f"{f}-{w}ranks-{p.replace(' ', '-')}" for f, w, p in FULL])
def test_ep_plans_train_like_one_process(ranks, family, world, plan):
    _assert_close(ranks(world).run(_train_on_rank, family, plan, timeout_s=300))


PIPELINED = [("mixtral", 4, "ep=2 pp=2 microbatches=2", 2),
             ("qwen2_moe", 4, "ep=2 pp=2 microbatches=2 ckpt", 2),
             ("qwen3_moe", 4, "ep=2 pp=2 microbatches=2 pp_schedule=zbv", 4),
             ("qwen2_moe", 8, "ep=2 tp=2 pp=2 microbatches=2", 2)]


@pytest.mark.full
@pytest.mark.parametrize("family, world, plan, layers", PIPELINED,
                         ids=[f"{f}-{w}ranks-{p.replace(' ', '-')}" for f, w, p, _ in PIPELINED])
def test_ep_in_pipeline_stages_trains_like_one_process(ranks, family, world, plan, layers):
    """The load-balancing loss spans the stages: each adds its layers' router sums to those
    the previous one sent behind the activation (``router_stats.py``); the last computes
    HF's loss, whose gradient reaches the first stage's routers through the pipeline."""
    _assert_close(ranks(world).run(_train_pipelined_on_rank, family, plan, layers,
                                   timeout_s=300))


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
    assert Plan.parse("ep=2 tp=2 pp=2 microbatches=2").validate(8).dp == 2
    for plan, world, key, instead in (
            ("ep=2 tp=4 tp_mode=2d", 8, "tp_mode=2d", "use tp_mode=1d"),
            ("ep=2 tp=2 sp_mode=split_gather", 4, "sp_mode=split_gather", "remove sp_mode")):
        with pytest.raises(PlanError, match=rf"ep=2 with {key} is not available yet.*{instead}"):
            Plan.parse(plan).validate(world)


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

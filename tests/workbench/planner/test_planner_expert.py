"""The planner's expert parallelism (``workbench/planner/expert_terms.py``) against its formulas.

What is protected: a Mixtral-style description (an HF ``MixtralConfig``) counts the very
parameters the HF model holds, routers and experts included; under ``ep`` a rank's model state
is ``(4 + 4 + 8) * (dense + experts / ep)`` bytes in fp32 at zero 0 (the formula of
``bench/moe/formulas.py``, which the bench checks against the runtime), ZeRO shards the experts
over their expert-data group (dp / ep ranks) and the rest over dp; the all-to-all bytes per step
are ``layers x micro-batches x 2 x tokens x top_k x hidden x bytes`` in forward and again in
backward, on the "ep" axis; the products gain ``top_k - 1`` expert MLPs and the router per
token, and the experts' gradients reduce over their expert-data group; plans the runtime
refuses (ep on a dense model, ep not dividing the experts) fail with a message saying what to
change. Arithmetic and one tiny HF model on the meta device: no ranks.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
import transformers

from kernels_runtime.mesh.plan import PlanError
from workbench.planner import ModelSpec, predict

MIXTRAL = transformers.MixtralConfig(
    hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=320, num_local_experts=4, num_experts_per_tok=2,
    max_position_embeddings=128)
ADAMW_FP32 = 4 + 4 + 8  # parameter, gradient, exp_avg, exp_avg_sq


@cache
def _hf_counts() -> tuple[int, int]:
    """(dense, expert) parameters of the HF model built from ``MIXTRAL`` (meta device)."""
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(MIXTRAL)
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return sum(p.numel() for p in model.parameters()) - expert, expert


def _spec(**overrides) -> ModelSpec:
    return ModelSpec.from_config(MIXTRAL, seq=32, batch=4, **overrides)


def test_description_counts_the_hf_models_parameters():
    dense, expert = _hf_counts()
    spec = _spec()
    assert (spec.experts, spec.top_k) == (4, 2)
    assert spec.param_count == dense + expert
    assert spec.layers * spec.experts * spec.expert_mlp_params == expert
    assert "4 experts (top-2)" in spec.describe()


@pytest.mark.parametrize("plan, world", [("ep=2", 2), ("dp=4 ep=4", 4), ("dp=4 ep=2", 4)])
def test_model_state_divides_the_experts_over_ep(plan, world):
    dense, expert = _hf_counts()
    p = predict(plan, _spec(), world_size=world)
    ep = p.plan.ep
    assert p.model_state_bytes == ADAMW_FP32 * (dense + expert / ep)
    assert "experts per block" in next(m.note for m in p.memory if m.category == "params")


def test_zero_shards_experts_over_their_expert_data_group():
    """zero=1 on dp=4 ep=2: the dense AdamW states over 4 ranks, the experts' (half of them on
    this rank) over the 2 ranks holding the same experts."""
    dense, expert = _hf_counts()
    p = predict("dp=4 ep=2 zero=1", _spec(), world_size=4)
    mem = p.memory_by_category()
    assert mem["params"] == 4 * (dense + expert / 2)
    assert mem["optimizer"] == 8 * (dense / 4 + expert / 2 / 2)


def test_dense_plan_of_a_moe_model_keeps_every_expert():
    dense, expert = _hf_counts()
    p = predict("dp=2", _spec(), world_size=2)
    assert p.model_state_bytes == ADAMW_FP32 * (dense + expert)
    assert "ep" not in p.comm_by_axis()


@pytest.mark.parametrize("plan, micro", [("ep=2", 1), ("ep=2 microbatches=2", 2),
                                         ("ep=2 bf16", 1)])
def test_all_to_all_bytes_per_step_follow_the_formula(plan, micro):
    spec = _spec()
    p = predict(plan, spec, world_size=2)
    elem = 2 if "bf16" in plan else 4
    tokens = spec.batch // micro * spec.seq  # a micro-batch's tokens on this rank
    per_layer = 2 * tokens * spec.top_k * spec.hidden * elem  # dispatch out + combine back
    items = [t for t in p.time if t.axis == "ep"]
    assert [t.phase for t in items] == ["forward", "backward"]
    for t in items:
        assert t.nbytes == spec.layers * micro * per_layer
        assert t.count == 2 * spec.layers * micro and t.seconds > 0
    assert p.comm_by_axis()["ep"] == sum(t.seconds for t in items)


def test_recomputation_repeats_the_forward_all_to_alls():
    spec = _spec()
    plain = predict("ep=2", spec, world_size=2)
    again = predict("ep=2 activation_checkpointing", spec, world_size=2)
    assert again.comm_by_axis()["ep"] == pytest.approx(1.5 * plain.comm_by_axis()["ep"])


def test_experts_add_top_k_minus_one_mlps_and_the_router_to_the_products():
    """2 FLOPs per weight per token forward, 4 backward: the dense layout's one MLP per token
    becomes top_k experts and a router, the same under ep=1 and ep=2."""
    spec = _spec()
    tokens = spec.batch * spec.seq
    extra = (spec.top_k - 1) * spec.expert_mlp_params + spec.hidden * spec.experts
    for plan, world in (("dp=2", 2), ("ep=2", 2)):
        p = predict(plan, spec, world_size=world)
        hw = p.setting.hw
        items = {t.name: t.seconds for t in p.time if "expert matmuls" in t.name}
        flops = 2 * spec.layers * extra * tokens
        assert items["forward expert matmuls"] == pytest.approx(flops / hw.forward_flops("fp32"))
        assert items["backward expert matmuls"] == pytest.approx(
            2 * flops / hw.backward_flops("fp32"))


@pytest.mark.parametrize("plan, world, group, op", [
    ("dp=4", 4, 4, "all_reduce"), ("dp=4 ep=2", 4, 2, "all_reduce"),
    ("dp=4 ep=2 zero=2", 4, 2, "reduce_scatter"), ("ep=2", 2, 1, None)])
def test_expert_gradients_reduce_over_the_expert_data_group(plan, world, group, op):
    """fp32 gradients of the rank's experts beyond the one MLP per block the dense reduction
    counts, over dp / ep ranks; nothing where each rank's experts are its own."""
    spec = _spec()
    p = predict(plan, spec, world_size=world)
    items = [t for t in p.time if t.name.startswith("expert gradient")]
    if op is None:
        assert items == []
        return
    (item,) = items
    held = spec.experts // p.plan.ep  # experts per block on this rank
    assert item.note == op and item.axis == "dp"
    assert item.nbytes == 4 * spec.layers * (held - 1) * spec.expert_mlp_params
    assert p.setting.data_ranks // p.plan.ep == group


def test_refused_plans_say_what_to_change():
    dense_spec = _spec(experts=0, top_k=0)
    with pytest.raises(PlanError, match="has none; give experts= and top_k="):
        predict("ep=2", dense_spec, world_size=2)
    with pytest.raises(PlanError, match="does not divide the model's 4 experts"):
        predict("dp=3 ep=3", _spec(), world_size=3)
    with pytest.raises(ValueError, match="needs top_k"):
        ModelSpec.from_config(dict(hidden=64, layers=2, heads=4, vocab=64, seq=8, batch=1,
                                   experts=4))

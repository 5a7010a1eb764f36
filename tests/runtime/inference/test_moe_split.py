"""How the engine splits a mixture-of-experts block, in one process: the arithmetic and the
refusals (issue 29, item 5). The 2-rank engine runs are in ``test_moe_engine.py``.

What is protected: the partial outputs of every rank's ``ServedExperts`` (E/ep experts, I/tp
features each) sum to the HF block's output, for Mixtral blocks under ep=2, tp=2 and ep=2 x
tp=2 and Qwen3-MoE blocks under ep=4 and ep=2 x tp=2, within 1e-6 relative (the all-reduce's
sum, done here by hand: each rank's partial is what it hands the all-reduce; measured about
1e-7). And a plan the engine cannot serve for a MoE model is refused with what to choose
instead: ep that does not divide the experts, tp that does not divide an expert's features,
ep on a dense model, ep or tp beside pp, a model parallelized for training under ep.
"""

from __future__ import annotations

import pytest
import torch

HIDDEN, TOKENS = 32, 24


def _model(family: str, experts: int = 4):
    import transformers

    common = dict(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, vocab_size=64,
                  max_position_embeddings=64, initializer_range=0.2)
    torch.manual_seed(0)
    if family == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=64, num_local_experts=experts, **common))
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        intermediate_size=64, moe_intermediate_size=32, num_experts=experts, head_dim=8,
        decoder_sparse_step=1, norm_topk_prob=True, **common))


@pytest.mark.parametrize(("family", "ep", "tp"), [
    ("mixtral", 2, 1), ("mixtral", 1, 2), ("mixtral", 2, 2), ("qwen3_moe", 4, 1),
    ("qwen3_moe", 2, 2)])
def test_rank_partials_sum_to_the_hf_block(family, ep, tp):
    from kernels_runtime.inference.moe import ExpertSplit, ServedExperts
    from kernels_runtime.policies.moe import moe_blocks

    _, block, spec = moe_blocks(_model(family))[0]
    x = torch.randn(2, TOKENS // 2, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = block(x)  # (b, s, h)
        partials = [ServedExperts(block, spec, ExpertSplit(ep, e, tp, t), None, [])(x)
                    for e in range(ep) for t in range(tp)]  # groups=[]: each rank's partial
    total = partials[0]
    for part in partials[1:]:
        total = total + part
    error = float((total - expected).norm() / expected.norm())
    assert error <= 1e-6, f"{family} ep={ep} tp={tp}: relative error {error:.1e}"


def _problem(model, plan: str, world: int) -> str | None:
    from kernels_runtime.inference.moe_plans import moe_problem
    from kernels_runtime.inference.plans import inference_plan

    return moe_problem(model, inference_plan(plan).validate(world))


def test_plans_the_engine_cannot_serve_for_moe_say_what_to_choose():
    import transformers

    from kernels_runtime.inference.moe_plans import parallelized_problem
    from kernels_runtime.mesh.plan import Plan

    three = _model("mixtral", experts=3)
    why = _problem(three, "ep=2", 2)
    assert "ep=2 does not divide the 3 experts" in why and "choose ep in [1, 3]" in why
    why = _problem(_model("mixtral"), "tp=3", 3)
    assert "tp=3 does not divide the 64 intermediate features" in why and "choose tp" in why
    torch.manual_seed(0)
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64))
    why = _problem(dense, "ep=2", 2)
    assert "has none" in why and "ep=1" in why
    assert _problem(dense, "tp=2", 2) is None  # dense plans are the engine's own business
    why = _problem(_model("mixtral"), "tp=2 pp=2", 4)
    assert "not available in the engine yet" in why and "ep or tp alone" in why
    assert _problem(_model("mixtral"), "dp=2 ep=2 tp=2", 4) is None
    assert _problem(_model("qwen3_moe"), "ep=4", 4) is None
    why = parallelized_problem(Plan.parse("ep=2").validate(2))
    assert "parallelized for training under ep=2" in why and "Engine(model, 'ep=2')" in why

"""The plan tuner's cost model: its formulas against REFERENCES.md, and its recommendations.

What is protected: the ZeRO, activation, FLOP and ring formulas reproduce the published numbers
(so a projection for a cluster we do not have can be trusted as far as the papers can);
``recommend`` never returns a plan over the memory budget and says what the smallest need is
when nothing fits; impossible plans fail with the runtime's own ``PlanError`` text. All pure
arithmetic: no torch, no ranks.
"""

from __future__ import annotations

import dataclasses

import pytest

from kernels_runtime.mesh.plan import PlanError
from workbench.planner import PROFILES, ModelSpec, NoPlanFitsError, predict, recommend
from workbench.planner.activations import (
    KORTHIKANTI,
    activation_bytes,
    korthikanti_layer_bytes,
    layer_bytes,
)
from workbench.planner.hardware import A100, H100, H200, Link
from workbench.planner.memory import paper_model_state_bytes, runtime_model_state_bytes
from workbench.planner.timing import ring_seconds

GPT3 = dict(hidden=12288, layers=96, heads=96, vocab=50257, seq=2048, batch=1, positions=2048)
GPT_1B = dict(hidden=2048, layers=24, heads=16, vocab=50257, seq=2048, batch=8)


def test_zero_paper_example_7_5b_on_64_gpus():
    per_stage = [round(sum(paper_model_state_bytes(7.5e9, 64, s)) / 1e9, 1) for s in range(4)]
    assert per_stage == [120.0, 31.4, 16.6, 1.9]
    # fp32: 4 + 4 + 8 bytes, the same sharding rules
    assert sum(paper_model_state_bytes(1e9, 8, 0, "fp32")) == 16e9
    assert paper_model_state_bytes(1e9, 8, 2, "fp32") == (4e9, 4e9 / 8, 8e9 / 8)
    # ZeRO-3 on FSDP2 keeps fp32 parameter and gradient shards: other split, same total
    for precision in ("fp32", "bf16"):
        assert sum(runtime_model_state_bytes(1e9, 8, 3, precision)) == pytest.approx(2e9)


def test_activation_memory_matches_korthikanti():
    s, b, h, a = 2048, 1, 12288, 96
    assert layer_bytes(KORTHIKANTI, s, b, h, a) == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    for t in (2, 8):
        assert layer_bytes(KORTHIKANTI, s, b, h, a, tp=t) == pytest.approx(
            s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
        assert layer_bytes(KORTHIKANTI, s, b, h, a, tp=t, sequence_parallel=True) == \
            pytest.approx(s * b * h / t * (34 + 5 * a * s / h))
        assert korthikanti_layer_bytes(s, b, h, a, t) == pytest.approx(
            layer_bytes(KORTHIKANTI, s, b, h, a, tp=t))
    # full recomputation keeps 2*s*b*h per layer (16-bit) plus one layer's activations
    spec = ModelSpec.from_config(GPT3)
    full = activation_bytes(spec, 1, 2, checkpointing=False)["layers"]
    ckpt = activation_bytes(spec, 1, 2, checkpointing=True)["layers"]
    assert full == pytest.approx(96 * layer_bytes(KORTHIKANTI, s, b, h, a))
    assert ckpt == pytest.approx(96 * 2 * s * b * h + layer_bytes(KORTHIKANTI, s, b, h, a))


def test_ring_all_reduce_time():
    # 1 GB over 8 A100s on NVLink (300 GB/s per direction), 5 us per step
    assert ring_seconds("all_reduce", 1e9, 8, 300e9, 5e-6) == pytest.approx(
        2 * 7 / 8 * 1e9 / 300e9 + 2 * 7 * 5e-6)
    assert ring_seconds("reduce_scatter", 1e9, 8, 300e9, 5e-6) == pytest.approx(
        7 / 8 * 1e9 / 300e9 + 7 * 5e-6)
    assert ring_seconds("all_reduce", 1e9, 1, 300e9, 5e-6) == 0.0


def _unit_hardware(**changes):
    """1 FLOP/s everywhere and nothing else costs: predicted seconds are FLOPs."""
    zero = {"fp32": float("inf"), "bf16": float("inf"), "fp16": float("inf")}
    ones = {"fp32": 1.0, "bf16": 1.0, "fp16": 1.0}
    hw = dataclasses.replace(PROFILES["A100"], matmul_flops=ones, matmul_bwd_flops=None,
                             attention_flops=None, attention_bwd_flops=None,
                             activation_rate=zero, elementwise_bandwidth=zero,
                             adam_rate=float("inf"), overhead={0: dataclasses.replace(
                                 PROFILES["A100"].overhead_for(0), step=0, micro=0, layer=0)})
    return dataclasses.replace(hw, **changes)


def test_training_flops_are_6_psi_plus_attention_and_megatron_with_recomputation():
    spec = ModelSpec.from_config(GPT3)
    L, h, s, V, B = spec.layers, spec.hidden, spec.seq, spec.vocab, 1
    hw = _unit_hardware()
    psi_matmul = L * 12 * h * h + V * h
    plain = predict("dp=1", spec, hw)
    assert plain.compute_time == pytest.approx(B * s * (6 * psi_matmul + 12 * L * h * s))
    ckpt = predict("dp=1 ckpt", spec, hw)
    megatron = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    assert ckpt.compute_time == pytest.approx(megatron)


def test_data_sheet_profiles_match_references():
    assert (A100.bf16_tflops, A100.memory_gb, A100.hbm_tbps, A100.nvlink_gbps,
            A100.internode_gbps) == (312, 80, 2.0, 300, 25)
    assert (H100.bf16_tflops, H100.memory_gb, H100.hbm_tbps, H100.nvlink_gbps,
            H100.internode_gbps) == (989, 80, 3.35, 450, 50)
    assert (H200.bf16_tflops, H200.memory_gb, H200.hbm_tbps, H200.nvlink_gbps,
            H200.internode_gbps) == (989, 141, 4.8, 450, 50)
    h100 = PROFILES["H100"]
    assert h100.devices_per_node == 8 and h100.device_memory == 80e9
    assert h100.link("all_reduce", 8) is h100.intra_node  # NVLink within a node
    assert h100.link("all_reduce", 16) is h100.inter_node  # InfiniBand beyond it


def test_zero_communication_volumes_and_accumulation():
    spec = ModelSpec.from_config(GPT_1B)
    psi = spec.param_count
    hw = _unit_hardware(intra_node=Link(1.0, 0.0))  # seconds = ring bytes per rank

    def comm(plan: str) -> float:
        return predict(plan, spec, hw).comm_time

    ring = 2 * 7 / 8 * psi * 4  # an fp32 all-reduce of the gradients moves 2(P-1)/P * bytes
    assert comm("dp=8 zero=0") == pytest.approx(ring)
    assert comm("dp=8 zero=1") == pytest.approx(ring)  # reduce-scatter + all-gather
    assert comm("dp=8 zero=2") == pytest.approx(ring)
    assert comm("dp=8 zero=3") == pytest.approx(1.5 * ring)  # ZeRO-3: 1.5x
    # gradient accumulation: stages 0/1 communicate once per step, stage 2 every micro-batch
    assert comm("dp=8 zero=1 mb=4") == pytest.approx(comm("dp=8 zero=1"))
    assert comm("dp=8 zero=2 mb=4") == pytest.approx(ring / 2 * 4 + ring / 2)


def test_overlap_hides_gradient_communication_behind_backward():
    spec = ModelSpec.from_config(GPT_1B)
    hidden = predict("dp=16 zero=0 bf16", spec, PROFILES["A100"])
    exposed = predict("dp=16 zero=0 bf16", spec, dataclasses.replace(PROFILES["A100"],
                                                                      overlap=0.0))
    assert exposed.exposed_comm_time == pytest.approx(exposed.comm_time)
    assert hidden.exposed_comm_time < 0.2 * hidden.comm_time
    assert hidden.step_time < exposed.step_time


def test_memory_tiers_and_categories():
    p = predict("dp=8 zero=1 bf16 mb=2 ckpt", GPT_1B, "H100")
    tiers = p.peak_by_tier()
    assert set(tiers) == {"device", "host", "disk"} and tiers["host"] == tiers["disk"] == 0
    mem = p.memory_by_category()
    psi = ModelSpec.from_config(GPT_1B).param_count
    assert (mem["params"], mem["grads"], mem["optimizer"]) == pytest.approx(
        (2 * psi, 2 * psi, 12 * psi / 8))
    assert p.peak_bytes == pytest.approx(sum(mem.values()))


def test_recommend_respects_the_budget_and_explains():
    budget = 40e9
    rec = recommend(GPT_1B, 8, budget, hardware="A100")
    assert rec.ranked and all(p.peak_bytes <= budget for p in rec.ranked)
    assert all(p.peak_bytes > budget for p in rec.over_budget)
    assert rec.best.step_time == min(p.step_time for p in rec.ranked)
    text = rec.explain()
    assert "why: fastest plan within the budget" in text and "40 GB per rank" in text
    assert "over the budget" in text  # a faster plan did not fit, and it says so
    unlimited = recommend(GPT_1B, 8, hardware="A100")
    assert unlimited.best.step_time <= rec.best.step_time


def test_recommend_says_the_smallest_need_when_nothing_fits():
    with pytest.raises(NoPlanFitsError) as info:
        recommend(GPT3, 8, 80e9, hardware="A100")
    smallest = info.value.smallest
    assert smallest is not None
    message = str(info.value)
    assert "no plan fits 80 GB per rank on 8 ranks" in message
    assert f"the smallest need is {smallest.peak_bytes / 1e9:.3g} GB" in message
    assert "zero=3" in message and "ckpt" in message  # the smallest plan, named


def test_invalid_plans_give_the_plan_error_text():
    spec = ModelSpec.from_config(GPT_1B)
    cases = {
        "dp=1 zero=1": "zero=1 shards model states over data-parallel ranks, but dp=1",
        "dp=2 zero=0 mb=3": "microbatches=3 does not divide the 8 samples",
        "dp=2 tp=3": "tp=3 does not divide the model's 16 attention heads",
        "dp=2 tp=2": "the cost model has no terms yet for tp=2",
        "dp=2 precision=int8": "precision='int8' is not supported",
    }
    for plan, text in cases.items():
        with pytest.raises(PlanError, match=text.replace("'", ".")):
            predict(plan, spec, "H100")
    with pytest.raises(PlanError, match=r"dp\*tp\*pp\*sp = 2\*1\*1\*1 = 2 but the pool has 3"):
        predict("dp=2 zero=1", spec, "H100", world_size=3)
    with pytest.raises(PlanError, match="dp=auto needs world_size"):
        predict("zero=1", spec, "H100")


def test_model_spec_from_hf_config_counts_parameters():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    spec = ModelSpec.from_config(cfg, batch=4)
    model = transformers.GPT2LMHeadModel(cfg)
    assert spec.param_count == sum(p.numel() for p in model.parameters())
    assert (spec.seq, spec.attention, spec.activation) == (16, "sdpa", "gelu_new")
    with pytest.raises(ValueError, match="lacks the batch"):
        ModelSpec.from_config(cfg)

"""``Plan`` parsing and validation: every impossible plan is a clear error before ranks work."""

from __future__ import annotations

import pytest

from kernels_runtime.mesh.plan import Plan, PlanError


def test_parse_round_trip_and_dp_inference():
    p = Plan.parse("dp=2 tp=2 zero=1 bf16")
    assert (p.dp, p.tp, p.zero_stage, p.precision) == (2, 2, 1, "bf16")
    assert Plan.parse(p.to_string()) == p
    assert Plan.parse("tp=2").validate(4).dp == 2
    assert Plan().validate(3).dp == 3
    assert Plan.parse("pp=2 mb=4 schedule=gpipe ckpt").validate(2).activation_checkpointing


INVALID = [
    ("dp=3", 4, None, "pool has 4 ranks"),
    ("tp=3", 4, None, "does not divide the 4 ranks"),
    ("zero=4", 2, None, "ZeRO stages"),
    ("zero=1 dp=1", 1, None, "dp=1"),
    ("tp_mode=2d tp=2", 2, None, "q\\*q"),
    ("tp_mode=2.5d tp=4 depth=2", 4, None, "q\\*q\\*2"),
    ("tp_mode=2.5d tp=8 depth=3", 8, None, "not divisible by tp_depth"),
    ("tp_depth=2 tp=2", 2, None, "only for tp_mode=2.5d"),
    ("precision=fp8", 2, None, "precision='fp8'"),
    ("tp_mode=3d", 2, None, "tp_mode='3d'"),
    ("pp=2 mb=1", 2, None, "microbatches=1"),
    ("pp=2 zero=2 mb=2 dp=2", 4, None, "zero=2 with pp=2"),
    ("sp=2", 2, None, "sp_mode=all_to_all"),
    ("sp_mode=split_gather", 2, None, "set tp>1"),
    ("tp=2 sp=2 sp_mode=split_gather", 4, None, "sp stays 1"),
    ("sp_mode=ring", 2, None, "but sp=1"),
    ("tp=4", 4, {"num_attention_heads": 6}, "6 attention heads"),
    ("pp=4 mb=4", 4, {"n_layer": 2}, "needs at least 4 blocks but the model has 2"),
    ("pp=2 mb=4 schedule=interleaved chunks=2", 2, {"n_layer": 3},
     "2 chunks per rank needs at least 4 blocks"),
    ("pp=2 mb=4 schedule=interleaved", 2, None, "add pp_chunks=2"),
    ("pp=2 mb=4 chunks=2", 2, None, "pp_chunks=2 is for pp_schedule=interleaved"),
    ("pp=2 mb=4 schedule=zbv chunks=3", 2, None, "exactly 2 chunks per rank"),
    ("sp=4 sp_mode=all_to_all", 4, {"n_head": 6}, "divisible|dividing"),
    ("dp=0", 2, None, "at least 1"),
    ("tp=4 tp_mode=2d", 4, {"num_attention_heads": 3}, "3 attention heads over the q=2 columns"),
    ("tp=4 tp_mode=2d", 4, {"hidden_size": 33}, "33 hidden size over the q=2 columns"),
    ("tp=8 tp_mode=2.5d depth=2", 8, {"num_key_value_heads": 1, "num_attention_heads": 4},
     "1 key/value heads over the q=2 columns"),
    ("offload=nvme", 2, None, "offload='nvme'"),
    ("pp=2 mb=3 schedule=interleaved chunks=2", 2, None, "use microbatches a multiple of 2"),
]


@pytest.mark.parametrize("text, world, config, message", INVALID)
def test_invalid_plans_name_the_field_and_a_fix(text, world, config, message):
    with pytest.raises(PlanError, match=message):
        Plan.parse(text).validate(world, config)


@pytest.mark.parametrize("text, message", [
    ("dp=two", "not an integer"),
    ("banana", "not understood"),
    ("speed=11", "unknown"),
    ("ckpt=maybe", "on or off"),
    ("zer=2", "plan key 'zer' is unknown; did you mean 'zero'\\? known keys: "),
    ("tp_mod=2d", "did you mean 'tp_mode'"),
    ("bf1", "not understood: did you mean bf16\\?"),
])
def test_unparseable_plan_strings(text, message):
    with pytest.raises(PlanError, match=message):
        Plan.parse(text)


def test_zero_shards_over_sequence_parallel_ranks_too():
    """sp ranks hold the same parameters, so ZeRO shards over dp x sp: dp=1 sp=2 is allowed."""
    assert Plan.parse("sp=2 sp_mode=ring zero=1").validate(2).dp == 1
    with pytest.raises(PlanError, match="dp=1"):
        Plan.parse("tp=2 zero=1").validate(2)


def test_a_grid_splits_heads_over_its_side_not_over_tp():
    """2D tp=4 (q=2) accepts 6 heads: each grid column holds 3; 1D tp=4 does not."""
    assert Plan.parse("tp=4 tp_mode=2d").validate(4, {"num_attention_heads": 6}).tp == 4
    with pytest.raises(PlanError, match="6 attention heads"):
        Plan.parse("tp=4").validate(4, {"num_attention_heads": 6})

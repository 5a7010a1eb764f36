"""Sequence-parallel plans that cannot split a batch fail with a clear error, the same on every
rank and before any collective (so no rank hangs), and the ranks stay usable afterwards."""

from __future__ import annotations

import pytest
import torch

from helpers.distributed import context


def _llama(heads: int = 4):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=heads, num_key_value_heads=2,
                                      vocab_size=96, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


def _odd_length(rank: int, world: int, plan: str, length: int) -> str:
    from kernels_runtime import parallelize_model

    model = parallelize_model(_llama(), ctx=context(plan))
    ids = torch.randint(0, 96, (2, length))
    try:
        model(input_ids=ids)
    except ValueError as err:
        message = str(err)
    else:
        message = "no error"
    ok = model(input_ids=torch.randint(0, 96, (2, 8))).logits.shape  # the ranks still agree
    return f"{message} | {tuple(ok)}"


def test_a_sequence_not_divisible_by_tp_under_split_gather_is_refused(ranks):
    for message in ranks(2).run(_odd_length, "tp=2 sp_mode=split_gather", 7, timeout_s=120):
        assert "sp_mode=split_gather with tp=2 splits the sequence into 2 equal parts, but " \
               "its length is 7; pad or cut the batch to a multiple of 2 (e.g. 8)" in message
        assert message.endswith("(2, 8, 96)")


def test_a_sequence_not_divisible_over_sp_is_refused_with_the_lengths_that_work(ranks):
    zigzag = ranks(2).run(_odd_length, "sp=2 sp_mode=ring", 6, timeout_s=120)
    for message in zigzag:  # ring attention's zig-zag layout cuts 2*sp chunks
        assert message.startswith("sp_mode=ring with sp=2: sequence length 6 does not split "
                                  "into the 2*sp=4 equal chunks of the zig-zag layout"), message
        assert "multiples of 4 (e.g. 4 or 8)" in message and message.endswith("(2, 8, 96)")
    for message in ranks(2).run(_odd_length, "sp=2 sp_mode=all_to_all", 7, timeout_s=120):
        assert message.startswith("sp_mode=all_to_all with sp=2: sequence length 7 does not "
                                  "split into the sp=2 equal chunks"), message


def _refusal(rank: int, world: int, plan: str, heads: int) -> str:
    from kernels_runtime import PlanError, parallelize_model

    try:
        parallelize_model(_llama(heads), ctx=context(plan))
    except PlanError as err:
        return str(err)
    return "no error"


@pytest.mark.slow
def test_ulysses_needs_each_ranks_heads_to_divide_by_sp(ranks):
    plan = "tp=2 sp=2 sp_mode=all_to_all"
    assert ranks(4).run(_refusal, plan, 4, timeout_s=120)[0] == "no error"  # 1 head per rank
    message = ranks(4).run(_refusal, plan, 2, timeout_s=120)[0]
    assert "divides each rank's 1 attention heads (of 2, tp=2) over sp=2" in message
    assert "sp_mode=ring" in message

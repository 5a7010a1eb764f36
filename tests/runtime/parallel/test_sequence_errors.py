"""Sequence-parallel plans that cannot split a batch fail with a clear error, the same on every
rank and before any collective (so no rank hangs), and the ranks stay usable afterwards."""

from __future__ import annotations

import torch

from helpers.distributed import context


def _llama():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
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

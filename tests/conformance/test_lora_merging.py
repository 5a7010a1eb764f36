"""Merging a split adapter into its split base layer, and back.

What is protected: under tp=2, peft's ``merge_adapter()`` on the parallelized model folds each
adapter into its layer's shard (B's rows of a column-parallel layer times the whole A, the
whole B times A's columns of a row-parallel one: each rank's delta has its shard's shape), so
the logits equal single-process peft's merged model; ``unmerge_adapter()`` takes it out again
(the adapters' logits). LLaMA's ``nn.Linear`` and GPT-2's transposed ``Conv1D``
(``fan_in_fan_out``), within 2e-6 of the float32 logits; every split base weight changes by
the merge and returns after the unmerge. An adapter added after the split is refused in words
at its forward.
"""

from __future__ import annotations

import pytest
import torch

from conformance.families import FAMILIES, global_batch
from conformance.lora import with_lora

pytest.importorskip("peft")
pytestmark = pytest.mark.slow  # two ranks, a few seconds


def _merge_on_rank(rank: int, world: int, family_name: str, plan: str) -> dict[str, float]:
    from kernels_runtime import parallelize_model

    from helpers.distributed import context

    family = FAMILIES[family_name]
    batch = {k: v for k, v in global_batch(family, 0).items() if k != "labels"}
    reference, model = with_lora(family, family.build()), with_lora(family, family.build())
    with torch.no_grad():
        want = reference(**batch).logits
        reference.merge_adapter()
        want_merged = reference(**batch).logits
        model = parallelize_model(model, plan, ctx=context(plan), verbose=False)
        got = model(**batch).logits
        bases = [p for n, p in model.named_parameters() if n.endswith("base_layer.weight")]
        before = [p.clone() for p in bases]
        model.merge_adapter()
        merged = model(**batch).logits
        moved = min((p - b).abs().max().item() for p, b in zip(bases, before))
        model.unmerge_adapter()
        unmerged = model(**batch).logits
        back = max((p - b).abs().max().item() for p, b in zip(bases, before))
    return {"adapters": (got - want).abs().max().item(),
            "merged": (merged - want_merged).abs().max().item(),
            "unmerged": (unmerged - want).abs().max().item(),
            "weights_moved": moved, "weights_back": back}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_merge_adapter_folds_split_adapters_into_their_shards(ranks, family):
    for rank, r in enumerate(ranks(2).run(_merge_on_rank, family, "tp=2", timeout_s=300)):
        assert r["adapters"] < 2e-6 and r["merged"] < 2e-6 and r["unmerged"] < 2e-6, (rank, r)
        # every split base weight took its adapter's delta in, and gave it back
        assert r["weights_moved"] > 1e-3 and r["weights_back"] < 1e-6, (rank, r)


def _late_adapter_on_rank(rank: int, world: int) -> str:
    from peft import LoraConfig

    from kernels_runtime import parallelize_model

    from helpers.distributed import context

    family = FAMILIES["llama"]
    batch = {k: v for k, v in global_batch(family, 0).items() if k != "labels"}
    model = parallelize_model(with_lora(family, family.build()), "tp=2", ctx=context("tp=2"),
                              verbose=False)
    model.add_adapter("late", LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))
    model.set_adapter("late")
    try:
        with torch.no_grad():
            model(**batch)
    except ValueError as e:
        return str(e)
    return "no error"


def test_an_adapter_added_after_parallelize_is_refused_in_words(ranks):
    """peft's ``add_adapter`` on a split model makes whole factors beside split bases: the
    forward names the adapter and the fix rather than failing on mismatched shapes."""
    for message in ranks(2).run(_late_adapter_on_rank, timeout_s=300):
        assert message.startswith("LoRA adapter 'late' was added after parallelize"), message
        assert "add every adapter" in message, message

"""LoRA fine-tuning (a peft ``PeftModel``) under a plan equals single-process peft.

What is protected: for each (family, plan) below, on real gloo ranks, the family wrapped in
random rank-8 adapters (``lora.with_lora``) and trained three SGD steps through ``parallelize``
and ``train_step`` gives single-process peft's losses (1e-5 relative) and first-step gradient of
every adapter parameter (1e-5 relative L2), assembled from the pieces each rank writes; only
adapter parameters have momentum buffers, and no frozen parameter holds a gradient after the
step. Under 1D tensor parallelism an adapter's factors split with their layer (A of a
row-parallel layer by input rows, B of a column-parallel one by output columns; on the 2D /
2.5D grid A by input and B by output features, chunk j of the grid column), so the pieces also
prove each factor's layout. Adapters that cannot split yet (DoRA, an adapter on the
vocabulary-parallel head, in 1D as on the grid) are refused by ``parallelize`` with a message
naming what works instead (``REFUSED``). Also: peft's names and ``disable_adapter()``
survive the split, and a tp=2 checkpoint loads into a plain ``PeftModel``. Each case takes a
few seconds on 2-4 ranks (``make test``); peft is optional (the module skips without it).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from conformance import harness
from conformance.families import FAMILIES
from conformance.lora import with_dora, with_head_lora, with_lora
from conformance.plans import OFFLOAD

pytest.importorskip("peft")

CASES: list[tuple[str, str, int]] = [
    *[(f, p, 2) for p in ("dp=2", "dp=2 zero=1", "dp=2 zero=2", "dp=2 zero=3")
      for f in ("gpt2", "llama")],
    *[(f, "tp=2", 2) for f in ("gpt2", "llama", "qwen2", "bert")],
    *[(f, "tp=2 sp_mode=split_gather", 2) for f in ("gpt2", "llama")],
    ("smollm2", "tp=3", 3),
    *[(f, p, 2) for p in ("pp=2 mb=2", "sp=2 sp_mode=ring", "sp=2 sp_mode=all_to_all")
      for f in ("gpt2", "llama")],
    *[(f, "dp=2 tp=2 zero=1", 4) for f in ("gpt2", "llama")],
    ("llama", "dp=2 zero=2 ckpt", 2),
    ("gpt2", "tp=2 ckpt", 2),
    ("llama", f"dp=2 zero=3 {OFFLOAD}", 2),
    ("llama", "tp=2 pp=2 mb=2", 4),
    ("gpt2", "dp=2 sp=2 sp_mode=ring zero=1", 4),
    ("gpt2", "tp=4 tp_mode=2d", 4),
    ("bert", "tp=4 tp_mode=2d", 4),
    ("llama", "tp=4 tp_mode=2d", 4),
    ("llama", "tp=8 tp_mode=2.5d depth=2", 8),
]

# (family, plan, ranks, wrap) -> a fragment the refusal must contain
REFUSED: dict[tuple[str, str, int, Callable], str] = {
    ("llama", "tp=4 tp_mode=2d", 4, with_head_lora): "lm_head: LoRA adapters on a "
                                                     "vocab-parallel module are not supported",
    ("llama", "tp=2", 2, with_dora): "and 13 more LoRA layers: a LoRA variant (DoRA, ...) "
                                     "does not split under tensor parallelism",
    ("llama", "tp=2", 2, with_head_lora): "lm_head: LoRA adapters on a vocab-parallel module "
                                          "are not supported",
}


def _cells():
    for family, plan, world in CASES:  # 4-rank cases: make test-full
        mark = pytest.mark.full if world >= 4 else pytest.mark.slow
        yield pytest.param(family, plan, world, with_lora, marks=mark, id=f"{family}-{plan}")
    for family, plan, world, wrap in REFUSED:
        yield pytest.param(family, plan, world, wrap, marks=pytest.mark.slow,
                           id=f"{family}-{plan}-{wrap.__name__}-refused")


@pytest.mark.parametrize("family, plan, world, wrap", list(_cells()))
def test_lora_trains_like_single_process_peft(request, ranks, references, family, plan, world,
                                              wrap):
    folder = str(request.getfixturevalue("smollm2_cut")) if family == "smollm2" else None
    cell = harness.Cell(f"{family}+{wrap.__name__.removeprefix('with_')}", plan, world)
    results = ranks(world).run(harness.train_on_rank, family, plan, folder, wrap,
                               timeout_s=300)
    refusals = {r["refused"] for r in results if "refused" in r}
    if (family, plan, world, wrap) in REFUSED:
        cell.outcome, cell.message = "refused", " | ".join(sorted(refusals))
        cell.record()
        assert len(refusals) == 1 and all("refused" in r for r in results), refusals
        assert REFUSED[family, plan, world, wrap] in cell.message, cell.message
        return
    assert not refusals, refusals
    key = ("lora", family, *harness.batch_split(plan, world))
    if key not in references:
        references[key] = harness.reference(FAMILIES[family], *key[2:], wrap=with_lora)
    ref = references[key]
    assert ref["grads"] and all(".lora_" in n for n in ref["grads"]), sorted(ref["grads"])
    harness.compare(cell, ref, results).record()
    assert not cell.problems, "\n".join(cell.problems)
    pieces = {name for r in results for name, *_ in r["grads"]}
    assert pieces == set(ref["grads"]), sorted(pieces ^ set(ref["grads"]))
    assert not any(r["frozen_grads"] for r in results), [r["frozen_grads"] for r in results]
    print(f"{family} {plan}: loss {cell.loss_rel:.2e}, grad {cell.grad_rel:.2e} ({cell.worst})")


@pytest.mark.slow
def test_split_lora_keeps_peft_names_switches_and_factor_layouts(ranks):
    """Under tp=2 peft's parameter names are unchanged, ``disable_adapter()`` still turns the
    adapters off (the base model's logits), and only the split factors have layouts: B of a
    column-parallel layer by output rows, A of a row-parallel one by input columns."""
    from conformance.lora import split_lora_on_rank

    results = ranks(2).run(split_lora_on_rank, "tp=2", timeout_s=300)
    for rank, r in enumerate(results):
        assert r["names"]
        assert r["on"] < 1e-4 and r["again"] == 0.0 and r["off"] < 1e-4, r
        prefix = "base_model.model.model.layers.0."
        q_b = r["layouts"][f"{prefix}self_attn.q_proj.lora_B.default.weight"]
        o_a = r["layouts"][f"{prefix}self_attn.o_proj.lora_A.default.weight"]
        assert q_b == ((128, 8), [(64 * rank, 0)], [(64, 8)]), q_b
        assert o_a == ((8, 128), [(0, 64 * rank)], [(8, 64)]), o_a
        assert not any(".lora_A." in n for n in r["layouts"] if "q_proj" in n)
        assert not any(".lora_B." in n for n in r["layouts"] if "o_proj" in n)
        assert len(r["layouts"]) == 2 * 7, sorted(r["layouts"])  # one split factor per layer


def test_the_policy_sees_through_peft():
    """A PeftModel gets its inner family's policy under peft's prefix, and each LoRA factor
    the split of its layer: B of a column-parallel layer, A of a row-parallel one."""
    from kernels_runtime.policies import get_policy

    family = FAMILIES["gpt2"]
    model = with_lora(family, family.build())
    policy = get_policy(model)
    resolved = policy.resolve(model)
    assert policy.name == "gpt2+peft" and resolved.complete, resolved.problems()
    assert policy.blocks(model) == list(model.base_model.model.transformer.h)
    styles = {n.removeprefix("base_model.model.transformer.h.0."): (s.style, s.fused, s.adapter)
              for n, s in resolved.specs.items() if ".h.0.attn." in n}
    assert styles == {
        "attn.c_attn.base_layer.weight": ("column", ("q", "k", "v"), ""),
        "attn.c_attn.base_layer.bias": ("column", ("q", "k", "v"), ""),
        "attn.c_attn.lora_A.default.weight": ("replicated", (), "A"),
        "attn.c_attn.lora_B.default.weight": ("column", ("q", "k", "v"), "B"),
        "attn.c_proj.base_layer.weight": ("row", (), ""),
        "attn.c_proj.base_layer.bias": ("row", (), ""),
        "attn.c_proj.lora_A.default.weight": ("row", (), "A"),
        "attn.c_proj.lora_B.default.weight": ("replicated", (), "B"),
    }, styles


@pytest.mark.slow
def test_a_split_lora_checkpoint_loads_into_single_process_peft(ranks, tmp_path):
    """Saved under tp=2, the checkpoint holds every adapter whole (its factors placed by their
    layouts): loaded into a plain PeftModel it equals one SGD step of single-process peft."""
    import torch

    from conformance.families import global_batch
    from conformance.lora import save_split_lora_on_rank
    from kernels_runtime import load_model

    ranks(2).run(save_split_lora_on_rank, "tp=2", str(tmp_path), timeout_s=300)
    family = FAMILIES["llama"]
    want = with_lora(family, family.build())
    opt = torch.optim.SGD(want.parameters(), lr=family.lr, momentum=0.9)
    want(**global_batch(family, 0)).loss.backward()
    opt.step()
    got = with_lora(family, family.build())
    moved = [n for (n, a), (_, b) in zip(want.named_parameters(), got.named_parameters())
             if not torch.allclose(a, b, rtol=1e-5, atol=1e-6)]
    assert moved and all(".lora_" in n for n in moved), moved  # the step changes adapters only
    load_model(tmp_path, got)
    for (name, a), (_, b) in zip(want.named_parameters(), got.named_parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name

"""peft LoRA layers on the 2D / 2.5D grid, beyond the training parity of
``tests/conformance/test_lora.py``.

What is protected: the grid leaves LoRA factors out of the modules it rebuilds on its own (they
are cut with their layer's base, never turned into SUMMA layers); under tp=4 tp_mode=2d peft's
parameter names survive, ``disable_adapter()`` still gives the base model's logits, and every
factor is cut by the features its rank holds (A by input columns, B by output rows: chunk j of
the grid column); a LoRA layer on a module 1D leaves whole but the grid rebuilds (BERT's masked-LM
transform, hidden -> hidden) also splits, with the unsplit logits and adapter gradients.
"""

from __future__ import annotations

import pytest
import torch

from helpers.distributed import context

pytest.importorskip("peft")

PLAN = "tp=4 tp_mode=2d"


def _bert_mlm():
    """A small masked-LM BERT with rank-4 adapters on query, value and every ``dense``,
    random B (peft starts it at zero), frozen base."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, vocab_size=60)
    model = transformers.BertForMaskedLM(config)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value", "dense"],
                      lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(model, lora).eval()


def _logits(model) -> torch.Tensor:
    ids = torch.randint(0, 60, (4, 7), generator=torch.Generator().manual_seed(1))
    return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits  # (4, 7, 60)


def _weighted(out: torch.Tensor) -> torch.Tensor:
    return (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum()


def test_the_grid_rebuilds_no_lora_factor_and_finds_the_replicated_base():
    from kernels_runtime.parallel.tensor.grid_parallel import grid_replicated
    from kernels_runtime.policies import get_policy

    model = _bert_mlm()
    resolved = get_policy(model).resolve(model)
    rebuilt = grid_replicated(resolved, "base_model.model.bert.encoder.layer",
                              "base_model.model.cls.predictions.decoder")
    assert not [p for p in rebuilt if ".lora_" in p], rebuilt
    assert "base_model.model.cls.predictions.transform.dense.base_layer" in rebuilt, rebuilt


def _mlm_on_rank(rank: int, world: int, plan: str) -> dict:
    from kernels_runtime import parallelize_model

    model = parallelize_model(_bert_mlm(), ctx=context(plan), verbose=False)
    out = _logits(model)
    _weighted(out).backward()
    with torch.no_grad(), model.disable_adapter():
        off = _logits(model)
    state, placed = model.parallel_state, {}
    for name, p in model.named_parameters():
        if p.grad is None:
            assert not p.requires_grad or ".lora_" not in name, name
            continue
        box = ((0,) * p.dim(), tuple(p.shape))
        placed[name] = [(s.offsets, s.sizes, p.grad[where].detach().clone())
                        for s, where in state.layout(name, p).shards(name, box)]
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    return {"out": out.detach(), "off": off, "placed": placed, "frozen": frozen,
            "names": [n for n, _ in model.named_parameters()]}


@pytest.mark.full  # 4 ranks
def test_lora_on_a_module_the_grid_rebuilds_matches_single_process_peft(ranks):
    model = _bert_mlm()
    names = [n for n, _ in model.named_parameters()]
    want = _logits(model)
    _weighted(want).backward()
    with torch.no_grad(), model.disable_adapter():
        want_off = _logits(model)
    results = ranks(4).run(_mlm_on_rank, PLAN, timeout_s=300)
    adapters = {n: p for n, p in model.named_parameters() if p.grad is not None}
    assert "base_model.model.cls.predictions.transform.dense.lora_A.default.weight" in adapters
    assert all(".lora_" in n for n in adapters), sorted(adapters)
    for r in results:
        assert r["names"] == names and not r["frozen"], r["frozen"]
        torch.testing.assert_close(r["out"], want.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["off"], want_off, rtol=1e-5, atol=1e-6)
        assert set(r["placed"]) == set(adapters), sorted(set(r["placed"]) ^ set(adapters))
    for name, p in adapters.items():
        got = torch.zeros_like(p.grad)
        for r in results:  # replicated pieces are written by every row, identically
            for offsets, sizes, grad in r["placed"][name]:
                got[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = grad
        rel = ((got - p.grad).norm() / p.grad.norm()).item()
        assert rel < 1e-5, f"{name}: {rel:.2e}"


@pytest.mark.full  # 4 ranks
def test_grid_lora_keeps_peft_names_switches_and_cuts_factors_by_grid_column(ranks):
    """LLaMA (hidden 128, q = 2): rank t = 2 i + j holds chunk j of q_proj's B (output rows)
    and of o_proj's A (input columns); every factor of the 14 layers is cut."""
    from conformance.lora import split_lora_on_rank

    results = ranks(4).run(split_lora_on_rank, PLAN, timeout_s=300)
    for rank, r in enumerate(results):
        j = rank % 2
        assert r["names"]
        assert r["on"] < 1e-4 and r["again"] == 0.0 and r["off"] < 1e-4, r
        prefix = "base_model.model.model.layers.0."
        q_b = r["layouts"][f"{prefix}self_attn.q_proj.lora_B.default.weight"]
        o_a = r["layouts"][f"{prefix}self_attn.o_proj.lora_A.default.weight"]
        assert q_b == ((128, 8), [(64 * j, 0)], [(64, 8)]), q_b
        assert o_a == ((8, 128), [(0, 64 * j)], [(8, 64)]), o_a
        assert len(r["layouts"]) == 2 * 14, sorted(r["layouts"])

"""2D (SUMMA on a 2 x 2 grid, tp=4) and 2.5D (two such grids, tp=8) tensor parallelism on HF
models, beyond the causal-LM parity of ``test_tensor_parallel.py``.

What is protected: a BERT classifier with a padding mask and a ViT classifier under tp=4
tp_mode=2d and tp=8 tp_mode=2.5d tp_depth=2 give the unsplit logits and every parameter's
gradient (1e-5 relative L2, assembled through the layouts); a checkpoint saved under 2D resumes
under 1D tp=2 and on one rank with the uninterrupted run's losses (1e-6), GPT-2's embedding
stored with its 50257 rows (also saved under 2.5D); a LLaMA saved with ``save_pretrained`` and
loaded with ``from_pretrained`` splits on the grid with the unsplit logits; tp=4 2d with
activation checkpointing, dp=2 x tp=4 2d with zero 1 and 3 and 2.5D tp=8 train with clipping
like one process (1e-5); a batch the grid's rows do not divide is a clear error on every rank.
"""

from __future__ import annotations

import pytest
import torch

from helpers.distributed import context

PLAN = "tp=4 tp_mode=2d"


def _bert():
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, vocab_size=60,
                                     num_labels=3)
    return transformers.BertForSequenceClassification(config)


def _vit():
    import transformers

    torch.manual_seed(0)
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=64, image_size=16, patch_size=8,
                                    num_labels=3, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0)
    return transformers.ViTForImageClassification(config)


def _logits(kind: str, model):
    g = torch.Generator().manual_seed(1)
    if kind == "vit":
        return model(pixel_values=torch.randn(4, 3, 16, 16, generator=g)).logits
    ids = torch.randint(0, 60, (4, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # padding
    return model(input_ids=ids, attention_mask=mask).logits


def _build(kind: str):
    return _vit() if kind == "vit" else _bert()


def _split(rank: int, world: int, kind: str, plan: str) -> dict:
    from kernels_runtime import parallelize_model

    model = parallelize_model(_build(kind), ctx=context(plan), verbose=False)
    out = _logits(kind, model)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    state, placed = model.parallel_state, {}
    for name, p in model.named_parameters():
        box = ((0,) * p.dim(), tuple(p.shape))
        placed[name] = [(s.offsets, s.sizes, p.grad[where].detach().clone())
                        for s, where in state.layout(name, p).shards(name, box)]
    return {"out": out.detach(), "placed": placed, "replaced": state.replaced}


@pytest.mark.parametrize("kind, plan", [
    pytest.param("bert", PLAN, marks=pytest.mark.slow),
    pytest.param("vit", PLAN, marks=pytest.mark.slow),
    pytest.param("bert", "tp=8 tp_mode=2.5d tp_depth=2", marks=pytest.mark.full),
    pytest.param("vit", "tp=8 tp_mode=2.5d tp_depth=2", marks=pytest.mark.full)])
def test_classifiers_on_the_grid_match_the_unsplit_model(ranks, kind, plan):
    model = _build(kind)
    want = _logits(kind, model)
    (want * torch.linspace(-1, 1, want.numel()).reshape(want.shape)).sum().backward()
    world = int(plan.split()[0].removeprefix("tp="))
    results = ranks(world).run(_split, kind, plan, timeout_s=300)
    for result in results:
        torch.testing.assert_close(result["out"], want.detach(), rtol=1e-5, atol=1e-6)
        assert any("Linear2D" in what for _, what in result["replaced"])
    for name, p in model.named_parameters():
        got = torch.zeros_like(p.grad)
        for result in results:  # replicated pieces are written by every rank, identically
            for offsets, sizes, grad in result["placed"][name]:
                got[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = grad
        rel = ((got - p.grad).norm() / p.grad.norm()).item() if p.grad.norm() > 1e-6 else \
            (got - p.grad).abs().max().item()
        assert rel < 1e-5, f"{name}: {rel:.2e}"


def _gpt2():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50257,
                                     n_positions=8, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, 50257, (4, 8), generator=torch.Generator().manual_seed(step))


def _train(rank: int, world: int, root: str, plan: str, save_at: int | None) -> list[float]:
    from kernels_runtime import load, parallelize, save, train_step

    ctx = context(plan)
    model = _gpt2()
    model, opt = parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ctx=ctx,
                             verbose=False)
    first = 0 if save_at is not None else load(root, model, opt)["step"]
    losses = []
    for step in range(first, 6):
        if step == save_at:
            save(root, model, opt, step=step)
        ids = _ids(step)[ctx.dp_rank::ctx.dp_size]
        losses.append(train_step(model, opt, [(ids, ids)]).loss)
    return losses


@pytest.mark.parametrize("saved, world", [
    pytest.param(PLAN, 4, marks=pytest.mark.slow),
    pytest.param("tp=8 tp_mode=2.5d tp_depth=2", 8, marks=pytest.mark.full)])
def test_a_grid_checkpoint_resumes_under_1d_and_on_one_rank(ranks, tmp_path, saved, world):
    import json

    root = str(tmp_path / "ckpt")
    uninterrupted = ranks(world).run(_train, root, saved, 3, timeout_s=300)[0]
    meta = json.loads((tmp_path / "ckpt" / "step-00000003" / "meta.json").read_text())
    assert meta["params"]["transformer.wte.weight"]["shape"] == [50257, 32]
    for plan, world in (("tp=2", 2), ("dp=1", 1)):
        resumed = ranks(world).run(_train, root, plan, None, timeout_s=300)[0]
        rel = max(abs(a - b) / abs(b) for a, b in zip(resumed, uninterrupted[3:]))
        assert rel < 1e-6, (plan, resumed, uninterrupted[3:])


def _llama():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=96, max_position_embeddings=8)
    return transformers.LlamaForCausalLM(config)


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(step))


def _llama_reference() -> list[float]:
    model = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(10):
        ids = _tokens(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _composed(rank: int, world: int, plan: str) -> list[float]:
    from kernels_runtime import parallelize, train_step

    ctx = context(plan)
    model = _llama()
    model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), ctx=ctx,
                             max_grad_norm=0.5, verbose=False)
    losses = []
    for step in range(10):
        mine = _tokens(step)[ctx.dp_rank::ctx.dp_size]
        losses.append(train_step(model, opt, [(mine, mine)]).loss)
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("plan, world", [
    ("tp=4 tp_mode=2d ckpt", 4),
    pytest.param("dp=2 tp=4 tp_mode=2d zero=1", 8, marks=pytest.mark.full),
    pytest.param("dp=2 tp=4 tp_mode=2d zero=3", 8, marks=pytest.mark.full),
    pytest.param("tp=8 tp_mode=2.5d tp_depth=2 ckpt", 8, marks=pytest.mark.full)])
def test_the_grid_composes_with_data_parallelism_checkpointing_and_clipping(ranks, plan, world):
    """Clipping at 0.5 acts every step, so the global norm must count each grid block, each
    column-replicated chunk and each depth copy once."""
    ref = _llama_reference()
    for losses in ranks(world).run(_composed, plan, timeout_s=300):
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        assert rel < 1e-5, (plan, losses, ref)


def _odd_batch(rank: int, world: int) -> str:
    from kernels_runtime import parallelize_model

    model = parallelize_model(_llama(), ctx=context(PLAN), verbose=False)
    try:
        model(input_ids=torch.randint(0, 96, (3, 8)))
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.slow  # 4 ranks
def test_a_batch_the_grid_rows_do_not_divide_is_refused(ranks):
    for message in ranks(4).run(_odd_batch, timeout_s=120):
        assert "batch of 3 does not split into the grid's 2 row blocks" in message, message
        assert "a multiple of 2" in message


def _pretrained(rank: int, world: int, folder: str, plan: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from kernels_runtime import parallelize_model

    model = parallelize_model(AutoModelForCausalLM.from_pretrained(folder), ctx=context(plan),
                              verbose=False)
    with torch.no_grad():
        return model(input_ids=_tokens(0)).logits


@pytest.mark.slow  # 4 ranks
def test_a_model_from_pretrained_splits_on_the_grid_with_the_same_outputs(ranks, tmp_path):
    folder = str(tmp_path / "llama")
    model = _llama()
    model.save_pretrained(folder)
    with torch.no_grad():
        want = model(input_ids=_tokens(0)).logits
    for got in ranks(4).run(_pretrained, folder, PLAN, timeout_s=300):
        assert (got - want).abs().max() < 1e-5


def _fit(out: torch.Tensor) -> torch.Tensor:
    """A bounded training loss: the logits regressed onto a fixed pattern."""
    return (out - torch.linspace(-1, 1, out.numel()).reshape(out.shape).sin()).pow(2).mean()


def _steps(model, opt, kind: str, backward) -> list[float]:
    losses = []
    for _ in range(10):
        loss = _fit(_logits(kind, model))
        backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _trained(rank: int, world: int, kind: str, plan: str) -> list[float]:
    from kernels_runtime import parallelize

    model = _build(kind)
    model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             ctx=context(plan), verbose=False)
    return _steps(model, opt, kind, opt.backward)


@pytest.mark.slow
@pytest.mark.parametrize("kind, plan", [
    ("bert", PLAN), ("vit", PLAN),
    pytest.param("bert", "tp=8 tp_mode=2.5d tp_depth=2", marks=pytest.mark.full),
    pytest.param("vit", "tp=8 tp_mode=2.5d tp_depth=2", marks=pytest.mark.full)])
def test_classifiers_on_the_grid_train_like_the_unsplit_model(ranks, kind, plan):
    """Ten SGD steps through ``parallelize`` give the unsplit run's losses (1e-5)."""
    model = _build(kind)
    ref = _steps(model, torch.optim.SGD(model.parameters(), lr=0.1), kind,
                 lambda loss: loss.backward())
    world = int(plan.split()[0].removeprefix("tp="))
    for losses in ranks(world).run(_trained, kind, plan, timeout_s=300):
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        assert rel < 1e-5, (kind, plan, losses, ref)

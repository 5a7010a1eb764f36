"""Checkpoints of an expert-parallel model: expert slices saved under one ep load under any other.

What is protected (issue 29, item 4): a tiny Mixtral (4 experts, top-2, 2 layers) trained one
AdamW step under ``ep=2`` and saved holds each expert slice as its box of the global fused
tensor (the layout the expert applier records), so the checkpoint is the model's plain HF
weights: ``load_model`` into a plain ``MixtralForCausalLM`` in one process, and ``export_hf``
to a ``save_pretrained`` folder that ``from_pretrained`` reads, give the ep model's logits
(1e-6 relative L2), on 2 ranks in the fast tier. In the full tier a ``dp=4 ep=2 zero=1``
checkpoint (experts split over ep, replicated and ZeRO-sharded over expert-dp) loads under
``ep=4``, ``dp=4 ep=2 zero=3`` (experts FSDP-sharded over expert-dp) and ``ep=4 zero=2`` with
its optimizer, each giving the saved model's logits, and the resumed step matches the
uninterrupted one (1e-5); the ep=4 zero=2 and a weights-only ep=2 model (expert-dp replicas
splitting their slices when saving) save in turn and load elsewhere with the same logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.distributed import context

HIDDEN, VOCAB, EXPERTS, SEQ, LR = 32, 64, 4, 8, 1e-2
TOL = 1e-6  # logits of the same weights
STEP_TOL = 1e-5  # after one more AdamW step, whose gradients another plan reduced in its order
IDS = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(7))


def _mixtral(seed: int = 0) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts_per_tok=2, num_local_experts=EXPERTS,
        vocab_size=VOCAB, max_position_embeddings=SEQ, initializer_range=0.2))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    """The whole batch's logits (every rank runs it: ep dispatches any tokens)."""
    with torch.no_grad():
        return model(input_ids=IDS).logits.detach().clone()  # (b, s, V)


def _step(model, opt, ctx) -> None:
    """One AdamW step on this rank's share of the batch (a loss every expert sees)."""
    share = IDS[ctx.dp_rank::ctx.dp_size]
    out = model(input_ids=share, labels=share)
    opt.zero_grad()
    opt.backward(out.loss)
    opt.finish_grad_sync()
    opt.step()


def _build(plan: str, seed: int = 0):
    from kernels_runtime import parallelize

    ctx = context(plan)
    model = _mixtral(seed)
    model, opt = parallelize(model, torch.optim.AdamW(model.parameters(), lr=LR), ctx=ctx,
                             verbose=False)
    return model, opt, ctx


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _save_ep2_and_read_plainly(rank: int, world: int,
                               root: str) -> tuple[dict[str, float], float]:
    """Train one step under ep=2 and save; then rank 0 reads the checkpoint as plain weights
    (no process group involved: ``load_model`` into an unparallelized model, and ``export_hf``
    then ``from_pretrained``) and compares their logits with the saved model's."""
    import transformers

    from kernels_runtime.checkpoint import export_hf, load_model, save

    model, opt, ctx = _build("ep=2")
    _step(model, opt, ctx)
    save(Path(root) / "ckpt", model, opt, step=1)  # returns once every rank's file is in
    saved = _logits(model)
    if rank != 0:
        return {}, 0.0
    plain = _mixtral(seed=1)  # other weights: the checkpoint must replace all of them
    before = _rel(_logits(plain), saved)
    errors = {}
    load_model(Path(root) / "ckpt", plain)
    errors["plain model loaded in one process"] = _rel(_logits(plain), saved)
    out = export_hf(Path(root) / "ckpt", _mixtral(seed=2), Path(root) / "hf")
    exported = transformers.MixtralForCausalLM.from_pretrained(out)
    errors["HF from_pretrained of the export"] = _rel(_logits(exported), saved)
    return errors, before


def test_ep2_checkpoint_loads_into_one_plain_process(ranks, tmp_path):
    """Expert shards of 2 ranks become the plain model's fused experts, and its HF export."""
    errors, before = ranks(2).run(_save_ep2_and_read_plainly, str(tmp_path), timeout_s=120)[0]
    assert before > 0.1  # the plain model's own weights give other logits
    assert len(errors) == 2
    bad = {what: err for what, err in errors.items() if not err <= TOL}
    assert not bad, f"relative L2 errors above {TOL}: {bad}"


def _reshard(rank: int, world: int, root: str) -> dict[str, float]:
    """Save under dp=4 ep=2 zero=1; load under other ep and zero, model-only and training."""
    from kernels_runtime import parallelize_model
    from kernels_runtime.checkpoint import load, load_model, save, save_model

    errors = {}
    model, opt, ctx = _build("ep=2 zero=1")
    _step(model, opt, ctx)
    save(Path(root) / "train", model, opt, step=1)
    expected = _logits(model)
    _step(model, opt, ctx)
    after_two = _logits(model)
    for plan in ("ep=4", "ep=2 zero=3"):
        other, _, _ = _build(plan, seed=1)
        load_model(Path(root) / "train", other)
        errors[f"logits, model loaded under {plan}"] = _rel(_logits(other), expected)
    resumed, resumed_opt, resumed_ctx = _build("ep=4 zero=2", seed=1)
    load(Path(root) / "train", resumed, resumed_opt)
    errors["logits, resumed under ep=4 zero=2"] = _rel(_logits(resumed), expected)
    _step(resumed, resumed_opt, resumed_ctx)  # the AdamW moments came back too
    errors["logits after the resumed step"] = _rel(_logits(resumed), after_two)
    resumed_logits = _logits(resumed)
    save_model(Path(root) / "model", resumed, step=2)  # ep=4 zero=2's own pieces
    again, _, _ = _build("ep=2 zero=3", seed=2)
    load_model(Path(root) / "model", again)
    errors["logits, ep=4 zero=2 save loaded under ep=2 zero=3"] = _rel(_logits(again),
                                                                       resumed_logits)
    # no optimizer: whole expert slices, their two expert-dp replicas writing half each
    weights = parallelize_model(_mixtral(seed=3), ctx=context("ep=2"), verbose=False)
    load_model(Path(root) / "model", weights)
    save_model(Path(root) / "weights", weights, step=2)
    last, _, _ = _build("ep=4", seed=4)
    load_model(Path(root) / "weights", last)
    errors["logits, ep=2 weights-only save loaded under ep=4"] = _rel(_logits(last),
                                                                      resumed_logits)
    return errors


@pytest.mark.full
def test_ep2_checkpoint_loads_under_ep4_and_zero3(ranks, tmp_path):
    for rank, errors in enumerate(ranks(4).run(_reshard, str(tmp_path), timeout_s=240)):
        assert len(errors) == 6
        bad = {what: err for what, err in errors.items()
               if not err <= (STEP_TOL if "step" in what else TOL)}
        assert not bad, f"rank {rank}: relative L2 errors above tolerance: {bad}"

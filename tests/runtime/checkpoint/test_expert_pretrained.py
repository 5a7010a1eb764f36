"""``load_pretrained`` of a mixture of experts under ep: built on meta, its experts read per box.

What is protected (issue 29): a tiny Mixtral (4 experts, top-2, 2 layers) written by HF
``save_pretrained`` (which stores one tensor per expert and projection, ``block_sparse_moe``
names) loads shard-wise, the model built on the meta device and parallelized before any weight
exists, under ``ep=2`` (each rank reading only its two experts' tensors into its slices of the
fused ``gate_up_proj`` / ``down_proj``), under ``ep=2 zero=3`` (those slices FSDP-sharded) and
under plain ``dp=2`` (the whole fused tensors), and gives the logits of ``from_pretrained`` on
the same folder (1e-6 relative L2); the training twin under ``ep=2 zero=1`` takes one AdamW
step like the model parallelized after ``from_pretrained`` (1e-5: its expert slices keep the
expert applier's mark when given storage, so they are stepped as experts). Two gloo ranks, in
``make test``.
"""

from __future__ import annotations

import pytest
import torch

from helpers.distributed import context

HIDDEN, VOCAB, EXPERTS, SEQ = 32, 64, 4, 8
TOL, STEP_TOL = 1e-6, 1e-5
IDS = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(3))


def _save(folder: str) -> None:
    import transformers

    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts_per_tok=2, num_local_experts=EXPERTS,
        vocab_size=VOCAB, max_position_embeddings=SEQ, initializer_range=0.2))
    model.save_pretrained(folder)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()  # (b, s, V): every rank runs the batch


def _load_and_compare(rank: int, world: int, folder: str) -> dict[str, float]:
    import transformers

    from kernels_runtime import load_pretrained, load_pretrained_for_training, parallelize

    reference = transformers.MixtralForCausalLM.from_pretrained(folder).eval()
    expected = _logits(reference)
    errors = {}
    for plan in ("ep=2", "dp=2", "ep=2 zero=3"):
        model = load_pretrained(folder, ctx=context(plan), verbose=False)
        if plan == "ep=2":  # the experts really are split: two of four per rank
            held = [p.shape[0] for n, p in model.named_parameters() if "gate_up_proj" in n]
            assert held == [EXPERTS // 2] * 2, held
        errors[plan] = _rel(_logits(model), expected)
    # training: the loaded twin and the model parallelized after from_pretrained, one step
    ctx = context("ep=2 zero=1")
    share = IDS[ctx.dp_rank::ctx.dp_size]
    losses = []
    for loaded in (True, False):
        make = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
        if loaded:
            model, opt = load_pretrained_for_training(folder, make, ctx=ctx, verbose=False)
        else:
            plain = transformers.MixtralForCausalLM.from_pretrained(folder)
            model, opt = parallelize(plain, make(plain.parameters()), ctx=ctx, verbose=False)
            model.train()
        out = model(input_ids=share, labels=share)
        opt.zero_grad()
        opt.backward(out.loss)
        opt.finish_grad_sync()
        opt.step()
        losses.append(_logits(model))
    errors["step"] = _rel(losses[0], losses[1])
    return errors


@pytest.mark.slow
def test_save_pretrained_mixtral_loads_under_ep_like_from_pretrained(ranks, tmp_path):
    _save(str(tmp_path))
    for rank, errors in enumerate(ranks(2).run(_load_and_compare, str(tmp_path),
                                               timeout_s=120)):
        assert max(errors[p] for p in ("ep=2", "dp=2", "ep=2 zero=3")) < TOL, (rank, errors)
        assert errors["step"] < STEP_TOL, (rank, errors)

"""Sequence parallelism over the sp axis (ring attention, Ulysses) on HF models, against the
unsplit model in one process.

What is protected: under sp=2 with sp_mode=ring (zig-zag shards) and sp_mode=all_to_all, a tiny
GPT-2 (learned positions) and LLaMA (RoPE, 4 query / 2 key/value heads) give the unsplit
model's logits and HF loss on every rank, and, summed over the sp ranks by data parallelism,
every parameter's gradient (1e-5 relative L2 per parameter; 1e-8 absolute where the reference
gradient is below 1e-6); ten SGD steps give the unsplit losses (1e-5). BERT with a padding mask
runs bidirectional ring attention with the same outputs at the real tokens and gradients. Each
rank's blocks see only its s/sp tokens (checked), so the comparison is of a split run.
"""

from __future__ import annotations

import pytest
import torch

from helpers.distributed import context

SEQ, BATCH, VOCAB = 16, 2, 96


def _model(kind: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB,
                                         n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config)
    if kind == "bert":
        config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=64,
                                         vocab_size=VOCAB, max_position_embeddings=SEQ,
                                         hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0)
        return transformers.BertModel(config, add_pooling_layer=False)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=VOCAB, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(config)


def _batch(step: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


MASK = torch.ones(BATCH, SEQ, dtype=torch.long)
MASK[1, 11:] = 0  # the second sequence is padded


def _loss(kind: str, model: torch.nn.Module, ids: torch.Tensor):
    if kind == "bert":
        out = model(input_ids=ids, attention_mask=MASK)
        hidden = out.last_hidden_state * MASK.unsqueeze(-1)  # real tokens only
        return hidden, (hidden.sin() * torch.arange(32)).mean()
    out = model(input_ids=ids, labels=ids)
    return out.logits, out.loss


def _reference(kind: str) -> dict:
    model = _model(kind)
    out, loss = _loss(kind, model, _batch())
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model = _model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(10):
        _, loss = _loss(kind, model, _batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"out": out.detach(), "grads": grads, "losses": losses}


def _split(rank: int, world: int, kind: str, plan: str) -> dict:
    from kernels_runtime import parallelize

    model = _model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx = context(plan)
    model, opt = parallelize(model, opt, ctx=ctx)
    before = ctx.comm.stats.snapshot()
    tokens = []  # tokens each block sees
    for block in model.parallel_state.blocks:
        block.register_forward_pre_hook(lambda m, args: tokens.append(args[0].shape[1]))
    out, loss = _loss(kind, model, _batch())
    opt.backward(loss)
    opt.finish_grad_sync()  # summed over sp (the data axis folds sp in)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    opt.zero_grad()
    losses = []
    for step in range(10):
        _, loss = _loss(kind, model, _batch(step))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    after = ctx.comm.stats.snapshot()
    sp_bytes = sum(c.get("bytes", 0) for op, groups in after.items()
                   for g, c in groups.items() if g == "sp") - sum(
        c.get("bytes", 0) for op, groups in before.items() for g, c in groups.items() if g == "sp")
    return {"out": out.detach(), "grads": grads, "losses": losses, "tokens": set(tokens),
            "replaced": model.parallel_state.replaced, "sp_bytes": sp_bytes}


CASES = [("gpt2", "sp=2 sp_mode=ring"), ("gpt2", "sp=2 sp_mode=all_to_all"),
         ("llama", "sp=2 sp_mode=ring"), ("llama", "sp=2 sp_mode=all_to_all"),
         ("bert", "sp=2 sp_mode=ring")]


@pytest.mark.parametrize("kind, plan", CASES)
def test_sequence_parallel_matches_the_unsplit_model(ranks, kind, plan):
    ref = _reference(kind)
    results = ranks(2).run(_split, kind, plan, timeout_s=300)
    for result in results:
        torch.testing.assert_close(result["out"], ref["out"], rtol=1e-5, atol=1e-5)
        rel = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], ref["losses"]))
        assert rel < 1e-5, (result["losses"], ref["losses"])
        assert result["tokens"] == {SEQ // 2}, "the blocks saw the whole sequence"
        assert any("over sp=2" in what for _, what in result["replaced"])
        assert result["sp_bytes"] > 0, "telemetry saw no traffic on the sp axis"
        small = []
        for name, want in ref["grads"].items():
            got = result["grads"][name]
            if want.norm() < 1e-6:
                small.append(name)
                assert (got - want).abs().max() < 1e-8, name
            else:
                err = ((got - want).norm() / want.norm()).item()
                assert err < 1e-5, f"{name}: relative L2 {err:.2e}"


def _composed(rank: int, world: int, plan: str) -> list[float]:
    from kernels_runtime import parallelize, train_step

    ctx = context(plan)
    model = _model("llama")
    model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), ctx=ctx)
    losses = []
    for step in range(10):
        mine = _batch(step)[ctx.dp_rank::ctx.dp_size]  # this data-parallel rank's rows
        losses.append(train_step(model, opt, [(mine, mine)]).loss)
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["dp=2 sp=2 sp_mode=ring zero=1",
                                  "dp=2 sp=2 sp_mode=all_to_all zero=3",
                                  "tp=2 sp=2 sp_mode=ring"])
def test_sequence_parallel_composes_with_data_and_tensor_parallelism(ranks, plan):
    """The sp ranks are data replicas for ZeRO (dp x sp), and tp splits each rank's heads."""
    ref = _reference("llama")["losses"]
    for losses in ranks(4).run(_composed, plan, timeout_s=300):
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        assert rel < 1e-5, (plan, losses, ref)


CLIP = 0.5


def _clipped_reference() -> list[float]:
    model = _model("llama")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(10):
        ids = _batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        assert norm > CLIP  # clipping acts at every step
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _clipped(rank: int, world: int, plan: str) -> list[float]:
    from kernels_runtime import parallelize, train_step

    ctx = context(plan)
    model = _model("llama")
    model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), ctx=ctx,
                             max_grad_norm=CLIP, verbose=False)
    losses = []
    for step in range(10):
        mine = _batch(step)[ctx.dp_rank::ctx.dp_size]
        losses.append(train_step(model, opt, [(mine, mine)]).loss)
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("plan, world", [("dp=2 tp=2 zero=2 ckpt", 4),
                                         ("tp=2 sp_mode=split_gather ckpt", 2),
                                         ("sp=2 sp_mode=ring ckpt", 2)])
def test_tensor_and_sequence_parallelism_with_checkpointing_and_clipping(ranks, plan, world):
    """Activation checkpointing recomputes the blocks (their collectives included) and the
    global gradient norm counts every shard and sp part once: the clipped losses match."""
    ref = _clipped_reference()
    for losses in ranks(world).run(_clipped, plan, timeout_s=300):
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        assert rel < 1e-5, (plan, losses, ref)

"""A checkpoint saved by a pipeline resumes under other splits with the uninterrupted losses.

What is protected: GPT-2 (tied embedding, held by the first and the last stage) trained with
AdamW under dp=2 x pp=2 zero=1 and saved at step 3 stores every parameter once, under its
one-process name and full shape, and resumes under pp=1 on one rank, tp=2, pp=4 and its own
plan with the losses the uninterrupted run had (1e-6 relative); a LLaMA saved under pp=2
resumes under dp=2 (no pipeline) the same way.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers.distributed import context

SEQ, BATCH, MICRO = 8, 8, 4


def _model(kind: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=32, n_layer=4, n_head=4, vocab_size=128, n_positions=SEQ, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=96, max_position_embeddings=SEQ))


def _steps(kind: str, plan: str, root: str, save_at: int | None, resume: bool) -> list[float]:
    from kernels_runtime import load, parallelize, save, train_step

    ctx = context(plan)
    model = _model(kind)
    model, opt = parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ctx=ctx,
                             verbose=False)
    start = load(root, model, opt)["step"] if resume else 0
    losses = []
    vocab = 128 if kind == "gpt2" else 96
    for step in range(start, 6):
        if step == save_at:
            save(root, model, opt, step=step)
        ids = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        mine = ids[ctx.dp_rank::ctx.dp_size]
        n = MICRO // ctx.dp_size if ctx.size("pp") == 1 else MICRO
        losses.append(train_step(model, opt, [(p, p) for p in mine.chunk(n)]).loss)
    return losses


def _save(rank: int, world: int, kind: str, plan: str, root: str) -> list[float]:
    return _steps(kind, plan, root, save_at=3, resume=False)


def _resume(rank: int, world: int, kind: str, plan: str, root: str) -> list[float]:
    return _steps(kind, plan, root, save_at=None, resume=True)


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_under_other_splits(ranks, tmp_path):
    root = str(tmp_path / "ckpt")
    uninterrupted = ranks(4).run(_save, "gpt2", "dp=2 pp=2 zero=1 mb=4", root,
                                 timeout_s=300)[0]
    meta = json.loads((tmp_path / "ckpt" / "step-00000003" / "meta.json").read_text())
    assert meta["params"]["transformer.wte.weight"]["shape"] == [128, 32]
    assert "lm_head.weight" not in meta["params"]  # tied: stored once
    assert sum(1 for name in meta["params"] if name.startswith("transformer.h.")) == 4 * 12
    for plan, world in (("dp=1", 1), ("tp=2", 2), ("pp=4 mb=4", 4),
                        ("dp=2 pp=2 zero=1 mb=4", 4)):
        resumed = ranks(world).run(_resume, "gpt2", plan, root, timeout_s=300)[0]
        rel = max(abs(a - b) / abs(b) for a, b in zip(resumed, uninterrupted[3:]))
        assert rel < 1e-6, (plan, resumed, uninterrupted[3:])


def test_a_llama_pipeline_checkpoint_resumes_without_the_pipeline(ranks, tmp_path):
    root = str(tmp_path / "ckpt")
    uninterrupted = ranks(2).run(_save, "llama", "pp=2 mb=4", root, timeout_s=300)[0]
    resumed = ranks(2).run(_resume, "llama", "dp=2", root, timeout_s=300)[0]
    rel = max(abs(a - b) / abs(b) for a, b in zip(resumed, uninterrupted[3:]))
    assert rel < 1e-6, (resumed, uninterrupted[3:])

"""``fit`` with an LR scheduler and ``evaluate`` on a padded held-out set, under dp=2 and tp=2,
against one plain PyTorch process.

The scheduler (transformers' warm-up + cosine) is built either on the user's optimizer before
``parallelize`` or on the returned ``BoostedOptimizer`` after; both must drive the learning rate
the rebuilt inner optimizer actually steps with (read by a step pre-hook on it)."""

from __future__ import annotations

import contextlib
import io
import math
import warnings

import pytest
import torch

from helpers.distributed import context

pytestmark = pytest.mark.full

VOCAB, SEQ, ROWS, STEPS, WARMUP = 64, 12, 8, 5, 2
LR = 1e-2
PLANS = ["dp=2", "tp=2"]


def _model():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


def _batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    start = torch.randint(0, VOCAB, (ROWS, 1), generator=g)
    ids = (start + torch.arange(SEQ) * 3) % VOCAB  # (ROWS, SEQ), learnable
    return {"input_ids": ids, "labels": ids.clone()}


def _scheduler(optimizer):
    from transformers import get_scheduler

    return get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=WARMUP,
                         num_training_steps=STEPS)


def _reference() -> tuple[list[float], list[float]]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = _scheduler(opt)
    losses, lrs = [], []
    for step in range(STEPS):
        lrs.append(opt.param_groups[0]["lr"])
        loss = model(**_batch(step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses, lrs


def _fit(rank: int, world: int, plan: str, built: str) -> dict:
    from kernels_runtime import fit, parallelize

    ctx = context(plan)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = _scheduler(opt) if built == "before" else None
    model, boosted = parallelize(model, opt, ctx=ctx, verbose=False)
    if sched is None:
        sched = _scheduler(boosted)
    used: list[float] = []  # the rate the rebuilt optimizer steps with
    boosted.inner.register_step_pre_hook(lambda o, a, k: used.append(o.param_groups[0]["lr"]))

    def local(step: int) -> dict[str, torch.Tensor]:
        b = _batch(step)
        n = ROWS // ctx.dp_size
        return {k: v[ctx.dp_rank * n:(ctx.dp_rank + 1) * n] for k, v in b.items()}

    err = io.StringIO()
    with contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # e.g. no "scheduler before step" warning
        history = fit(model, boosted, (local(s) for s in range(STEPS)), steps=STEPS,
                      scheduler=sched)
    return {"losses": [h["loss"] for h in history.train], "lrs": [h["lr"] for h in history.train],
            "used": used, "bar": err.getvalue()}


@pytest.mark.parametrize("built", ["before", "after"])
@pytest.mark.parametrize("plan", PLANS)
def test_fit_with_a_warmup_cosine_schedule_matches_one_process(ranks, plan, built):
    losses, lrs = _reference()
    assert lrs[0] == 0.0 and max(lrs) == pytest.approx(LR)  # warm-up, then cosine decay
    for rank, got in enumerate(ranks(2).run(_fit, plan, built, timeout_s=120)):
        assert got["used"] == pytest.approx(lrs, abs=1e-12), (rank, got["used"], lrs)
        assert got["lrs"] == pytest.approx(lrs, abs=1e-12)
        assert got["losses"] == pytest.approx(losses, abs=1e-5), (rank, got["losses"], losses)
        assert ("train" in got["bar"]) == (rank == 0), got["bar"]  # the bar on rank 0 only


def _held_out() -> list[dict[str, list[int]]]:
    """Seven rows of different lengths, some labels masked (as a prompt's would be)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for n in (5, 12, 3, 9, 7, 11, 4):
        ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        labels = [-100 if i < 2 else t for i, t in enumerate(ids)]
        out.append({"input_ids": ids, "labels": labels})
    return out


def _evaluated(rank: int, world: int, plan: str) -> dict:
    from kernels_runtime import evaluate, parallelize_model
    from kernels_runtime.data import eval_batches

    ctx = context(plan)
    model = parallelize_model(_model(), ctx=ctx, verbose=False)
    batches = eval_batches(_held_out(), 2, ctx.dp_rank, ctx.dp_size, pad_id=0)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        result = evaluate(model, batches)
    return {**result, "bar": err.getvalue()}


@pytest.mark.parametrize("plan", [*PLANS, "pp=2 mb=2", "dp=2 zero=3"])
def test_evaluate_weights_tokens_like_one_process(ranks, plan):
    model = _model()
    total = count = 0.0
    with torch.no_grad():  # each row alone, unpadded: the sum of its counted tokens' losses
        for row in _held_out():
            ids, labels = torch.tensor([row["input_ids"]]), torch.tensor([row["labels"]])
            n = int((labels[:, 1:] != -100).sum())
            total += model(input_ids=ids, labels=labels).loss.item() * n
            count += n
    want = total / count
    for rank, got in enumerate(ranks(2).run(_evaluated, plan, timeout_s=120)):
        assert got["tokens"] == count
        assert got["loss"] == pytest.approx(want, rel=1e-5), (plan, rank, got, want)
        assert got["perplexity"] == pytest.approx(math.exp(want), rel=1e-5)
        assert ("eval" in got["bar"]) == (rank == 0), got["bar"]  # the bar on rank 0 only


def _sft(rank: int, world: int, folder: str, data_file: str) -> dict:
    import transformers

    from kernels_runtime import fit, parallelize
    from kernels_runtime.data import (
        chat_examples,
        eval_batches,
        load_rows,
        pack,
        shard_rows,
        train_batches,
    )

    ctx = context("dp=2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    rows = load_rows({"train": data_file, "test": data_file}, split="train")
    mine = chat_examples(tokenizer, shard_rows(rows, ctx.dp_rank, ctx.dp_size, seed=0))
    held = chat_examples(tokenizer, load_rows(data_file).select(range(4)))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32,
                                      intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    model, opt = parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), ctx=ctx,
                             verbose=False)
    pad = tokenizer.pad_token_id
    stream = train_batches(pack(mine, max_length=128), 2, 0, 1, pad_id=pad)  # already sharded
    history = fit(model, opt, stream, steps=8, progress=False, eval_every=4,
                  eval_batches=eval_batches(held, 2, ctx.dp_rank, ctx.dp_size, pad_id=pad))
    return {"train": [h["loss"] for h in history.train], "eval": history.eval}


def test_chat_sft_from_a_jsonl_file_trains_under_dp(ranks, smollm2, tmp_path):
    """The whole path a fine-tuning notebook takes: file rows, dp shards, assistant-only labels,
    packing, fit with periodic evaluation. Ranks hold different packed rows, so this checks
    that it runs and learns (the parity of each part is tested above and in tests/runtime/data)."""
    import json

    answers = ["Paris is the capital of France.", "Red, blue and yellow.", "It is 144."]
    rows = [{"messages": [{"role": "user", "content": f"Question {i}?"},
                          {"role": "assistant", "content": answers[i % 3]}]} for i in range(24)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = ranks(2).run(_sft, str(smollm2.folder), str(path), timeout_s=240)
    for got in results:
        assert got["eval"] == results[0]["eval"]  # evaluate agrees on every rank
        assert [e["step"] for e in got["eval"]] == [4, 8]
        assert got["eval"][-1]["loss"] < got["eval"][0]["loss"]
        assert got["train"][-1] < got["train"][0]

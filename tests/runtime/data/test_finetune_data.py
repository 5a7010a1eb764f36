"""Fine-tuning data: assistant-only labels from the real SmolLM2 chat template, packing that
keeps every token and label, and dp sharding of file rows that is disjoint and complete."""

from __future__ import annotations

import json

import pytest
import torch

from kernels_runtime.data import (
    chat_example,
    chat_examples,
    counted_tokens,
    eval_batches,
    load_rows,
    pack,
    pad_rows,
    shard_order,
    shard_rows,
    train_batches,
)

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "system", "content": "Answer in one word."},
     {"role": "user", "content": "Name a primary color."},
     {"role": "assistant", "content": "Red"},
     {"role": "user", "content": "And another?"},
     {"role": "assistant", "content": "Blue\n\nor yellow."}],
    [{"role": "user", "content": "12 x 12?"},
     {"role": "assistant", "content": "  144 (twelve dozen)"},
     {"role": "user", "content": "Thanks"}],
]


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2.folder)


def _spans(labels: list[int]) -> list[list[int]]:
    """Maximal runs of labelled tokens."""
    runs, run = [], []
    for t in labels:
        if t == -100:
            if run:
                runs.append(run)
            run = []
        else:
            run.append(t)
    return runs + ([run] if run else [])


@pytest.mark.slow  # the real tokenizer: converted with SmolLM2 (make test converts it anyway)
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one", "two-turns", "user-last"])
def test_labels_cover_exactly_the_assistant_turns(tokenizer, conversation):
    example = chat_example(tokenizer, conversation)
    ids, labels = example["input_ids"], example["labels"]
    # the template's text; its tokens too, except where BPE would merge across a turn's edge
    # (the answer "  144" after "assistant\n"): each piece is tokenized as generation sees it
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(conversation, tokenize=False)
    if conversation is not CONVERSATIONS[2]:
        assert ids == list(tokenizer.apply_chat_template(conversation, tokenize=True,
                                                         return_dict=True)["input_ids"])
    assert all(t in (-100, i) for t, i in zip(labels, ids))  # labels are the ids where trained
    answers = [m["content"] for m in conversation if m["role"] == "assistant"]
    runs = _spans(labels)
    assert [tokenizer.decode(r) for r in runs] == [a + "<|im_end|>\n" for a in answers]
    unlabelled = tokenizer.decode([i for i, t in zip(ids, labels) if t == -100])
    for m in conversation:  # every other message is in the unlabelled text, no answer is
        assert (m["content"] in unlabelled) == (m["role"] != "assistant"), m


@pytest.mark.slow
def test_bad_messages_and_cut_conversations(tokenizer):
    with pytest.raises(ValueError, match="'role' and 'content'"):
        chat_example(tokenizer, [{"text": "hi"}])
    with pytest.raises(ValueError, match="no 'messages' field"):
        chat_examples(tokenizer, [{"conversation": CONVERSATIONS[0]}])
    cut = chat_examples(tokenizer, [{"messages": c} for c in CONVERSATIONS], max_length=20)
    assert len(cut) < len(CONVERSATIONS)  # system prompts fill 20 tokens: unlabelled, dropped
    assert all(len(e["input_ids"]) <= 20 for e in cut)


def _examples(lengths: list[int]) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in lengths:
        ids = torch.randint(3, 90, (n,), generator=g).tolist()
        keep = torch.rand(n, generator=g) < 0.6
        out.append({"input_ids": ids, "labels": [i if k else -100 for i, k in zip(ids, keep)]})
    return out


def test_packing_keeps_every_token_and_label():
    examples = _examples([5, 9, 3, 12, 1, 7, 7, 4, 11])
    rows = pack(examples, max_length=16)
    assert all(len(r["input_ids"]) <= 16 for r in rows)
    assert [t for r in rows for t in r["input_ids"]] == \
        [t for e in examples for t in e["input_ids"]]
    starts = [p == 0 for r in rows for p in r["position_ids"]]
    labels = [t for r in rows for t in r["labels"]]
    want = [t for e in examples for t in e["labels"]]
    assert sum(starts) == len(examples)  # positions restart once per example
    # every label kept but each example's first: no label across an example boundary
    assert [t for t, s in zip(labels, starts) if not s] == [t for t, s in zip(want, starts)
                                                             if not s]
    assert all(t == -100 for t, s in zip(labels, starts) if s)
    batch = pad_rows(rows, pad_id=2)
    assert batch["input_ids"].shape == batch["position_ids"].shape == (len(rows), 16)
    assert batch["attention_mask"].sum() == sum(len(e["input_ids"]) for e in examples)
    with pytest.raises(ValueError, match="more than max_length=4"):
        pack(examples, max_length=4)


def test_pad_rows_masks_padding_and_counts_tokens():
    examples = _examples([3, 6])
    batch = pad_rows(examples, pad_id=2, multiple_of=4)
    assert batch["input_ids"].shape == (2, 8)
    assert batch["attention_mask"].tolist() == [[1] * 3 + [0] * 5, [1] * 6 + [0] * 2]
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()
    want = sum(sum(t != -100 for t in e["labels"][1:]) for e in examples)
    assert counted_tokens(batch) == want


@pytest.mark.parametrize("n,dp", [(10, 1), (10, 2), (11, 2), (7, 4), (3, 4)])
def test_shards_are_disjoint_complete_and_seeded(n, dp):
    shares = [shard_order(n, r, dp, seed=5) for r in range(dp)]
    flat = [i for s in shares for i in s]
    assert sorted(flat) == list(range(n))  # every row once
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert shares == [shard_order(n, r, dp, seed=5) for r in range(dp)]
    if n > 3:
        assert shares != [shard_order(n, r, dp, seed=6) for r in range(dp)]


def test_rows_from_a_jsonl_file_shard_over_dp_ranks(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [{"id": i, "messages": CONVERSATIONS[i % 3]} for i in range(9)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_rows(str(path))
    assert len(data) == 9
    shares = [shard_rows(data, r, 2, seed=1) for r in range(2)]
    assert sorted(i for s in shares for i in s["id"]) == list(range(9))
    assert shares[0][0]["messages"] == CONVERSATIONS[shares[0][0]["id"] % 3]


def test_eval_batches_cover_every_example_once_with_equal_counts():
    examples = _examples([4, 5, 6, 7, 8, 9, 10])
    per_rank = [eval_batches(examples, 2, r, 2, pad_id=2) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == 2
    total = sum(counted_tokens(b) for bs in per_rank for b in bs)
    assert total == sum(sum(t != -100 for t in e["labels"][1:]) for e in examples)
    assert sum(b["input_ids"].shape[0] for bs in per_rank for b in bs) == 8  # one filler row
    stream = train_batches(examples, 2, 1, 2, pad_id=2, seed=0, epochs=2)
    assert [b["input_ids"].shape[0] for b in stream] == [2, 1, 2, 1]  # 3 rows a rank an epoch

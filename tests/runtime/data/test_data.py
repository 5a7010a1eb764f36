"""Data helpers: the stdlib corpus is real, cached safely, and DP batches match one process."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.utils.data import DistributedSampler

from kernels_runtime.data import (
    ByteTokenizer,
    TokenBatches,
    cache_path,
    distributed_loader,
    shard_indices,
    stdlib_corpus,
    train_val_split,
)

SMALL = 200_000


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> torch.Tensor:
    return stdlib_corpus(SMALL, cache_dir=tmp_path_factory.mktemp("corpus"))


# ---- corpus -------------------------------------------------------------------------------


def test_corpus_is_real_python_and_sized(tokens):
    assert tokens.dtype == torch.uint8 and tokens.dim() == 1
    assert tokens.numel() == SMALL
    raw = tokens.numpy().tobytes()
    assert b"def " in raw and b"import " in raw
    assert b"# ==== " in raw  # file separator


def test_corpus_is_deterministic_and_prefix_stable(tmp_path, tokens):
    again = stdlib_corpus(SMALL, cache_dir=tmp_path)  # fresh dir: rebuilt from scratch
    assert torch.equal(again, tokens)
    shorter = stdlib_corpus(1000, cache_dir=tmp_path)
    assert torch.equal(shorter, tokens[:1000])


def test_cache_hit_reads_the_file_without_rebuilding(tmp_path):
    first = stdlib_corpus(SMALL, cache_dir=tmp_path)
    path = cache_path(SMALL, tmp_path)
    assert path.is_file() and path.stat().st_size == SMALL
    mtime = path.stat().st_mtime_ns
    second = stdlib_corpus(SMALL, cache_dir=tmp_path)
    assert torch.equal(first, second)
    assert path.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp files left behind


def test_cache_dir_env_var(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "env"))
    stdlib_corpus(5000)
    assert cache_path(5000).parent == tmp_path / "env"
    assert cache_path(5000).is_file()


def test_concurrent_builders_agree(tmp_path):
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda _: stdlib_corpus(50_000, cache_dir=tmp_path), range(4)))
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert [p.name for p in tmp_path.iterdir()] == [cache_path(50_000, tmp_path).name]


def test_invalid_max_bytes(tmp_path):
    with pytest.raises(ValueError, match="max_bytes"):
        stdlib_corpus(0, cache_dir=tmp_path)


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x  # héllo ✓"
    ids = tok.encode(text)
    assert tok.vocab_size == 256 and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # a split character is replaced


def test_train_val_split(tokens):
    train, val = train_val_split(tokens, 0.1)
    assert train.numel() + val.numel() == tokens.numel()
    assert val.numel() == SMALL // 10
    assert torch.equal(torch.cat([train, val]), tokens)
    with pytest.raises(ValueError):
        train_val_split(tokens, 1.0)


# ---- TokenBatches -------------------------------------------------------------------------


def test_batch_shapes_and_labels_in_transformers_convention(tokens):
    tb = TokenBatches(tokens, seq_len=32, global_batch=8)
    x, y = tb.batch(3)
    assert x.shape == y.shape == (8, 32)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x, y) and x.data_ptr() != y.data_ptr()  # the loss shifts the labels
    flat = tokens.long()
    for start, row_x in zip(tb.global_starts(3).tolist(), x):  # real corpus windows
        assert torch.equal(flat[start : start + 32], row_x)


def test_train_steps_objective_learns_the_next_token_not_the_one_after():
    """With ``train_step``'s default objective, a model fit on TokenBatches predicts the token
    that follows: on a corpus counting 0, 1, 2, ... it learns x -> x + 1."""
    from kernels_runtime.api.objective import causal_lm_loss

    model = torch.nn.Sequential(torch.nn.Embedding(16, 16), torch.nn.Linear(16, 16))

    class Wrapped(torch.nn.Module):  # an HF-style model: labels in, shifted loss out
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, input_ids, labels):
            logits = self.net(input_ids)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 16),
                                                     labels[:, 1:].reshape(-1))
            return type("Out", (), {"loss": loss, "logits": logits})

    wrapped = Wrapped()
    opt = torch.optim.Adam(wrapped.parameters(), lr=0.1)
    data = TokenBatches(torch.arange(4000) % 16, seq_len=8, global_batch=8)
    for step in range(60):
        loss = causal_lm_loss(wrapped, data.batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert model(torch.arange(15)).argmax(-1).tolist() == list(range(1, 16))


@pytest.mark.parametrize("dp_size", [2, 4])
def test_ranks_reassemble_the_single_process_batch(tokens, dp_size):
    ref_x, ref_y = TokenBatches(tokens, 16, 8, seed=7).batch(5)
    parts = [TokenBatches(tokens, 16, 8, r, dp_size, seed=7).batch(5) for r in range(dp_size)]
    assert all(p[0].shape == (8 // dp_size, 16) for p in parts)
    assert torch.equal(torch.cat([p[0] for p in parts]), ref_x)
    assert torch.equal(torch.cat([p[1] for p in parts]), ref_y)


def test_reproducible_across_instances_and_resume(tokens):
    a = TokenBatches(tokens, 16, 4, seed=1)
    b = TokenBatches(tokens, 16, 4, seed=1, start_step=10)
    assert torch.equal(a.batch(10)[0], next(iter(b))[0])
    assert torch.equal(a.batch(10)[0], TokenBatches(tokens, 16, 4, seed=1).batch(10)[0])
    assert not torch.equal(a.batch(10)[0], a.batch(11)[0])
    assert not torch.equal(a.batch(0)[0], TokenBatches(tokens, 16, 4, seed=2).batch(0)[0])
    it = iter(a)
    assert [torch.equal(next(it)[0], a.batch(s)[0]) for s in range(3)] == [True] * 3


def test_microbatches_concatenate_to_the_batch(tokens):
    tb = TokenBatches(tokens, 16, 12, dp_rank=1, dp_size=2)
    mbs = tb.microbatches(2, 3)
    assert len(mbs) == 3 and all(m[0].shape == (2, 16) for m in mbs)
    x, y = tb.batch(2)
    assert torch.equal(torch.cat([m[0] for m in mbs]), x)
    assert torch.equal(torch.cat([m[1] for m in mbs]), y)
    with pytest.raises(ValueError, match="micro-batches"):
        tb.microbatches(2, 4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"global_batch": 6, "dp_size": 4}, "not divisible by dp_size"),
        ({"seq_len": SMALL}, "too long"),
        ({"dp_rank": 2, "dp_size": 2}, "out of range"),
    ],
)
def test_token_batches_errors(tokens, kwargs, match):
    args = {"seq_len": 16, "global_batch": 8} | kwargs
    with pytest.raises(ValueError, match=match):
        TokenBatches(tokens, **args)


# ---- shard_indices / distributed_loader ---------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 3, 10, 17])
@pytest.mark.parametrize("dp_size", [1, 2, 4])
@pytest.mark.parametrize("shuffle", [False, True])
def test_shard_indices_cover_and_match_distributed_sampler(n, dp_size, shuffle):
    for drop_last in (False, True):
        shards = [
            shard_indices(n, r, dp_size, shuffle=shuffle, drop_last=drop_last, seed=3)
            for r in range(dp_size)
        ]
        expect_len = n // dp_size if drop_last else math.ceil(n / dp_size)
        assert all(len(s) == expect_len for s in shards)
        flat = [i for s in shards for i in s]
        if drop_last:
            assert len(set(flat)) == len(flat)  # disjoint
        else:
            assert set(flat) == set(range(n))  # padded cover
        for r, shard in enumerate(shards):
            ds = list(range(n))
            ref = DistributedSampler(ds, dp_size, r, shuffle=shuffle, seed=3, drop_last=drop_last)
            assert len(ref) == len(shard)
            if n:
                assert list(ref) == shard


def test_epoch_changes_the_order():
    e0 = shard_indices(100, 0, 2, epoch=0)
    e1 = shard_indices(100, 0, 2, epoch=1)
    assert e0 != e1 and e0 == shard_indices(100, 0, 2, epoch=0)
    assert sorted(e0 + shard_indices(100, 1, 2, epoch=0)) == list(range(100))


def test_distributed_loader_yields_this_ranks_shard():
    data = [torch.tensor([i]) for i in range(10)]
    loader = distributed_loader(data, 2, dp_rank=1, dp_size=3, shuffle=False)
    assert loader.num_workers == 0
    got = torch.cat([b.flatten() for b in loader]).tolist()
    assert got == shard_indices(10, 1, 3, shuffle=False)
    loader = distributed_loader(data, 4, dp_rank=0, dp_size=2, seed=1)
    first = [b.tolist() for b in loader]
    loader.sampler.set_epoch(1)
    assert [b.tolist() for b in loader] != first


def test_train_step_moves_nested_batches_to_the_rank_device():
    """Loaders yield host tensors; ``to_device`` keeps the batch's structure (dicts, named
    tuples, lists) and returns CPU tensors unchanged on CPU ranks."""
    from collections import namedtuple

    import torch

    from kernels_runtime.api import to_device

    Pair = namedtuple("Pair", "x y")
    x = torch.arange(4)
    batch = {"a": Pair(x, [x, 3]), "b": (x,)}
    moved = to_device(batch, torch.device("cpu"))
    assert isinstance(moved["a"], Pair) and isinstance(moved["a"].y, list)
    assert moved["a"].x is x and moved["a"].y[1] == 3 and moved["b"][0] is x
    meta = to_device(batch, torch.device("meta"))  # another device: every tensor moves
    assert meta["a"].x.device.type == "meta" and meta["a"].y[0].device.type == "meta"
    assert meta["b"][0].device.type == "meta" and meta["a"].y[1] == 3

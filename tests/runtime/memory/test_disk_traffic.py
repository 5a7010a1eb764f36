"""What the disk tier moves: a payload read back and unchanged is evicted again without a write
(its file is a copy until someone changes the values), one about to be overwritten whole is
not read, the spill folder holds exactly the files the store accounts for, and freed buffers
are reused only where nothing else can refer to them (never a chunk's parameters)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kernels_runtime.comm.accelerator import Accelerator
from kernels_runtime.memory.disk import DiskStore
from kernels_runtime.memory.tiers import Tier, TierStore


@pytest.fixture
def store(tmp_path: Path):
    tiers = TierStore(Accelerator.host(), disk=lambda: DiskStore(tmp_path))
    yield tiers
    tiers.close()


def _folder_bytes(store: TierStore) -> int:
    store.settle()
    return sum(f.stat().st_size for f in store.disk.folder.iterdir())


def _moved(store: TierStore, pair: tuple[str, str]) -> int:
    return store.moved.get(pair, 0)


def test_an_unchanged_payload_is_evicted_again_without_a_write(store: TierStore):
    p = store.allocate("c0.master", 4096, torch.float32, Tier.HOST)
    p.handle.copy_(torch.arange(4096.0))
    store.move(p, Tier.DISK)
    store.settle()
    assert _moved(store, ("host", "disk")) == p.nbytes and store.disk.writes == 1
    store.move(p, Tier.HOST)  # read back: the file stays, a copy of the values
    assert torch.equal(p.handle, torch.arange(4096.0)) and p.copy_on_disk
    store.move(p, Tier.DISK)  # nothing changed: nothing written
    assert store.writes_skipped == 1 and store.disk.writes == 1
    assert _moved(store, ("host", "disk")) == p.nbytes  # no bytes moved the second time
    assert store.evictions == 2 and _folder_bytes(store) == store.file_bytes == p.nbytes
    store.move(p, Tier.HOST)
    store.modified(p)  # a user of the values says it changes them
    p.handle.add_(1)
    store.move(p, Tier.DISK)
    store.settle()
    assert store.disk.writes == 2 and store.disk.in_place == 1  # the same file, rewritten
    store.move(p, Tier.HOST)
    assert torch.equal(p.handle, torch.arange(4096.0) + 1)


def test_a_payload_overwritten_whole_is_not_read(store: TierStore):
    p = store.allocate("c0.param", 4096, torch.float32, Tier.HOST)
    store.move(p, Tier.DISK)
    store.settle()
    store.move(p, Tier.DEVICE, fill=False)
    assert store.disk.reads == 0 and not p.copy_on_disk and p.handle.numel() == 4096
    p.handle.fill_(3.0)
    store.move(p, Tier.DISK)
    store.settle()
    store.move(p, Tier.HOST)
    assert store.disk.reads == 1 and bool((p.handle == 3.0).all())
    assert _folder_bytes(store) == store.file_bytes == p.nbytes


def test_a_freed_payload_leaves_its_file_for_the_next_of_its_key(store: TierStore):
    g = store.adopt("c0.grad", torch.ones(4096), Tier.HOST)
    store.move(g, Tier.DISK)
    store.settle()
    store.move(g, Tier.HOST)
    store.free(g, recycle=True)
    assert os.listdir(store.disk.folder) == ["c0.grad"] and store.file_bytes == 4096 * 4
    again = store.adopt("c0.grad", torch.full((4096,), 2.0), Tier.HOST)
    store.move(again, Tier.DISK)  # the stale file is no copy: written, in place
    store.settle()
    assert store.disk.in_place == 1 and _folder_bytes(store) == store.file_bytes == 4096 * 4


def test_freed_buffers_are_reused_only_when_nothing_else_refers_to_them(store: TierStore):
    state = store.allocate("c0.exp_avg", 4096, torch.float32, Tier.HOST)
    param = store.allocate("c0.param", 4096, torch.float32, Tier.HOST)
    param.viewed = True  # the model's parameters point into it
    saved = param.handle[:100].view(10, 10)  # as autograd keeps a weight for backward
    state_memory, param_memory = state.handle.data_ptr(), param.handle.data_ptr()
    for p in (state, param):
        store.move(p, Tier.DISK)
    store.settle()  # both written: only the state's memory is free for reuse
    assert store.host_pool.nbytes == state.nbytes
    again = store.allocate("c1.exp_avg", 4096, torch.float32, Tier.HOST)
    assert again.handle.data_ptr() == state_memory and bool((again.handle == 0).all())
    assert store.host_pool.nbytes == 0
    store.move(param, Tier.HOST)  # read back (new memory); evicted again without a write
    store.move(param, Tier.DISK)
    assert store.host_pool.nbytes == param.nbytes  # nothing refers to the read-back memory
    reused = store.host_pool.take(4096, torch.float32)
    assert reused.data_ptr() != param_memory  # what the saved view holds never came back
    assert saved.data_ptr() == param_memory

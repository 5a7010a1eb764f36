"""What the disk tier moves: a payload read back and unchanged is evicted again without a write
(its file is a copy until someone changes the values), one about to be overwritten whole is
not read, the spill folder holds exactly the files the store accounts for, and freed buffers
are reused only where nothing else can refer to them (never a chunk's parameters); a read ahead
of a payload still being written keeps the write's memory instead of reading the disk, and the
read-aheads of a use still to come survive the step's drop of the others."""

from __future__ import annotations

import os
import threading
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


class GatedDisk(DiskStore):
    """A disk store whose writes wait for ``gate``: a write is in flight for as long as the test
    needs."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.gate = threading.Event()

    def _write(self, key: str, tensor: torch.Tensor) -> None:
        self.gate.wait(timeout=30)
        super()._write(key, tensor)


def test_a_read_ahead_of_a_payload_being_written_keeps_its_memory(tmp_path: Path):
    disk = GatedDisk(tmp_path)
    store = TierStore(Accelerator.host(), disk=lambda: disk)
    try:
        g = store.adopt("c1.grad", torch.arange(4096.0), Tier.HOST)
        memory = g.handle.data_ptr()
        store.move(g, Tier.DISK)  # written behind: in flight until the gate opens
        store.prefetch(g)  # wanted again: nothing to read, the write's memory holds it
        disk.gate.set()
        store.settle()  # the write completes and is collected; its memory stays for the fetch
        assert store.working[Tier.HOST] == g.nbytes  # a read-ahead's buffer, not model state
        store.move(g, Tier.HOST)
        assert disk.reads == 0 and _moved(store, ("disk", "host")) == 0
        assert g.handle.data_ptr() == memory and torch.equal(g.handle, torch.arange(4096.0))
        assert store.working[Tier.HOST] == 0 and store.used[Tier.HOST] == g.nbytes
    finally:
        disk.gate.set()
        store.close()


def test_drop_reads_keeps_the_read_aheads_of_a_use_to_come(store: TierStore):
    kept, dropped = (store.allocate(f"c{i}.master", 4096, torch.float32, Tier.HOST)
                     for i in range(2))
    kept.handle.fill_(2.0)
    for p in (kept, dropped):
        store.move(p, Tier.DISK)
    store.settle()
    for p in (kept, dropped):
        store.prefetch(p)
    assert store.working[Tier.HOST] == 2 * kept.nbytes
    assert store.drop_reads(keep={kept.key}) == dropped.nbytes
    assert store.working[Tier.HOST] == kept.nbytes
    store.move(kept, Tier.HOST)  # the read started before the drop serves it
    assert store.disk.reads <= 2 and bool((kept.handle == 2.0).all())  # (the other cancelled?)
    assert _moved(store, ("disk", "host")) == kept.nbytes and store.working[Tier.HOST] == 0


def test_deferred_steps_widen_the_write_behind_and_pool_but_not_a_value_set_by_hand(
        store: TierStore):
    wb, pool = store.write_behind_bytes, store.host_pool.limit
    store.widen_write_behind(3 * wb)
    store.size_host_pool(3 * pool)
    assert (store.write_behind_bytes, store.host_pool.limit) == (3 * wb, 3 * pool)
    store.widen_write_behind(1)  # never narrower
    store.size_host_pool(1)
    assert (store.write_behind_bytes, store.host_pool.limit) == (3 * wb, 3 * pool)
    store.write_behind_bytes = 0  # by hand (every write waited for): it stays
    store.widen_write_behind(4 * wb)
    assert store.write_behind_bytes == 0

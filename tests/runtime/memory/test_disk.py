"""The disk tier: tensors round-trip through files exactly, a failed write never replaces a
complete file, and the spill folder is refused where spilling would not free memory (tmpfs) or
could not work (unwritable), removed on cleanup, and removed after a crash only for dead ranks
of the restarted pool."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kernels_runtime.memory import disk_io
from kernels_runtime.memory.disk import DiskSpillError, DiskStore, measure_disk_bandwidth
from kernels_runtime.memory.spill import (
    MEMORY_FILESYSTEMS,
    POOL_ENV,
    SPILL_ENV,
    SpillDir,
    SpillDirInMemory,
    SpillError,
    mount_of,
    remove_stale,
    spill_root,
)

from helpers.disk import disk_folder

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A fresh folder on a real disk: tmp_path, or where this machine keeps that in RAM, one
    under /var/tmp or the checkout (``helpers.disk``)."""
    with disk_folder(tmp_path, "disk-test-") as folder:
        yield folder


@pytest.fixture
def store(tmp_path: Path):
    with DiskStore(tmp_path, threads=4) as s:
        yield s


@pytest.mark.parametrize("tensor", [
    torch.randn(1000),
    torch.randn(257).to(torch.bfloat16),
    torch.arange(-500, 500, dtype=torch.int64),
    torch.tensor(3.25),
    torch.tensor([7], dtype=torch.int8),
    torch.empty(0),
], ids=["fp32", "bf16", "int64", "0-d", "1-element", "empty"])
def test_round_trip_keeps_every_bit(store: DiskStore, tensor: torch.Tensor):
    assert store.write("t", tensor).result() is None
    assert store.contains("t") and store.nbytes("t") == tensor.numel() * tensor.element_size()
    out = torch.empty_like(tensor)
    assert store.read("t", out).result() is out
    assert torch.equal(out, tensor) and out.dtype == tensor.dtype
    assert not (store.folder / "t.tmp").exists()


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "cached"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "bounced"])
def test_large_tensors_move_a_window_at_a_time(tmp_path: Path, monkeypatch, direct, aligned):
    """Direct I/O moves a tensor ``aligned_empty`` made in place and any other through a
    bounce window; without direct I/O a cache window at a time. Several windows and a partial
    one, bit for bit, the file exactly the tensor's size."""
    monkeypatch.setattr(disk_io, "WINDOW", 4096)
    monkeypatch.setattr(disk_io, "CACHE_WINDOW", 4096)
    values = torch.randn(10_001).to(torch.bfloat16)  # 4 full windows and a partial one
    tensor = disk_io.aligned_empty(10_001, torch.bfloat16).copy_(values) if aligned else values
    if direct and not disk_io.direct_io_works(tmp_path):
        pytest.skip(f"{tmp_path} does not take O_DIRECT")
    with DiskStore(tmp_path, direct=direct) as store:
        store.write("w", tensor).result()
        assert store.nbytes("w") == 20_002
        out = disk_io.aligned_empty(10_001, torch.bfloat16) if aligned else \
            torch.empty_like(values)
        assert torch.equal(store.read("w", out).result(), values)
        store.write("w", values * 2).result()  # the same size: rewritten in place
        assert store.in_place == 1 and os.listdir(tmp_path) == ["w"]
        assert torch.equal(store.read("w", out).result(), values * 2)


def test_a_failed_rewrite_in_place_leaves_no_file_to_read(store: DiskStore, monkeypatch):
    store.write("k", torch.ones(1024)).result()

    def broken(fd: int, tensor: torch.Tensor) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(disk_io, "write_direct", broken)
    monkeypatch.setattr(disk_io, "write_cached", broken)
    with pytest.raises(DiskSpillError, match="'k'.*Input/output error"):
        store.write("k", torch.full((1024,), 2.0)).result()
    assert not store.contains("k") and os.listdir(store.folder) == []


def test_many_keys_concurrently_and_the_counters(store: DiskStore):
    tensors = {f"chunk{i}": torch.full((4096 + i,), float(i)) for i in range(48)}
    writes = [store.write(k, t) for k, t in tensors.items()]
    for w in writes:
        w.result()
    outs = {k: torch.empty_like(t) for k, t in tensors.items()}
    reads = {k: store.read(k, outs[k]) for k in tensors}
    for k, r in reads.items():
        assert torch.equal(r.result(), tensors[k])
    total = sum(t.numel() * 4 for t in tensors.values())
    assert (store.writes, store.reads) == (48, 48)
    assert store.bytes_written == store.bytes_read == total
    assert store.write_seconds > 0 and store.read_seconds > 0


def test_operations_on_one_key_keep_their_order(store: DiskStore):
    for value in range(10):
        store.write("k", torch.full((1 << 16,), float(value)))
    out = store.read("k", torch.empty(1 << 16)).result()
    assert torch.equal(out, torch.full((1 << 16,), 9.0))
    store.write("k", out)
    store.delete("k")  # waits for the write: the file cannot reappear
    assert not store.contains("k") and os.listdir(store.folder) == []


def test_missing_key_and_wrong_size_are_clear_errors(store: DiskStore):
    with pytest.raises(DiskSpillError, match="'absent'.*no such spilled tensor"):
        store.read("absent", torch.empty(4)).result()
    store.write("k", torch.zeros(8)).result()
    with pytest.raises(DiskSpillError, match=r"holds 32 bytes but the out tensor has 16"):
        store.read("k", torch.empty(4)).result()
    with pytest.raises(ValueError, match="contiguous host tensor"):
        store.write("k", torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="plain file name"):
        store.write("../escape", torch.zeros(1))


FSIZE_LIMIT = r"""
import json, resource, sys, torch
from kernels_runtime.memory import disk_io
from kernels_runtime.memory.disk import DiskSpillError, DiskStore
store = DiskStore(sys.argv[1])
store.write("k", torch.ones(16384)).result()  # 64 KiB: the complete version
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
try:
    store.write("k", torch.full((65536,), 2.0)).result()  # 256 KiB: past the limit
    error = None
except DiskSpillError as e:
    error = str(e)
out = store.read("k", torch.empty(16384)).result()
print(json.dumps({"error": error, "intact": bool(out.eq(1).all()),
                  "files": sorted(__import__("os").listdir(sys.argv[1]))}))
"""


def test_a_failed_write_keeps_the_complete_version(tmp_path: Path):
    result = subprocess.run([sys.executable, "-c", FSIZE_LIMIT, str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["error"] and str(tmp_path) in report["error"]
    assert "file-size limit" in report["error"] and "'k'" in report["error"]
    assert report["intact"] and report["files"] == ["k"]  # no .tmp left behind


def test_bandwidth_is_measured_and_its_file_removed(disk: Path):
    write, read = measure_disk_bandwidth(disk, 16 * 2**20)
    assert write > 0 and read > 0
    assert os.listdir(disk) == []


# ---- the spill folder ----------------------------------------------------------------------
def test_spill_root_prefers_argument_then_environment(monkeypatch, tmp_path: Path):
    monkeypatch.setenv(SPILL_ENV, str(tmp_path / "env"))
    assert spill_root(tmp_path / "arg") == tmp_path / "arg"
    assert spill_root() == tmp_path / "env"
    monkeypatch.delenv(SPILL_ENV)
    assert spill_root().name == "workbench-spill"


def test_spill_dir_layout_owner_and_cleanup(disk: Path, monkeypatch):
    monkeypatch.setenv(POOL_ENV, "pool-a")
    first, second = SpillDir(disk, 0), SpillDir(disk, 1)
    assert first.path == disk / "pool-a" / "rank0" and first.path.is_dir()
    assert first.path.stat().st_mode & 0o777 == 0o700
    owner = json.loads((first.path / "owner.json").read_text())
    assert owner["pid"] == os.getpid() and {"hostname", "start_time"} <= set(owner)
    with pytest.raises(SpillError, match="already used"):
        SpillDir(disk, 0)
    first.cleanup()
    first.cleanup()  # idempotent
    assert not first.path.exists() and second.path.is_dir()
    second.cleanup()
    assert not (disk / "pool-a").exists()
    monkeypatch.delenv(POOL_ENV)
    own = SpillDir(disk, 3)
    assert own.path.parent.name == f"process-{os.getpid()}"
    own.cleanup()


def test_spill_dir_refuses_tmpfs():
    if mount_of("/dev/shm")[1] not in MEMORY_FILESYSTEMS:
        pytest.skip("/dev/shm is not tmpfs here")
    with pytest.raises(SpillDirInMemory, match=r"/dev/shm/refused.*tmpfs.*spill_dir="):
        SpillDir(Path("/dev/shm/refused"), 0, pool="p")
    assert not Path("/dev/shm/refused").exists()


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_spill_dir_refuses_an_unwritable_path(disk: Path, where: str):
    if where == "proc":
        root = Path("/proc/workbench-spill")
    else:
        (disk / "file").write_text("not a folder")
        root = disk / "file" / "spill"
    with pytest.raises(SpillError) as caught:
        SpillDir(root, 0, pool="p")
    assert str(root / "p" / "rank0") in str(caught.value)
    assert "WORKBENCH_SPILL_DIR" in str(caught.value)


OWNER = r"""
import sys
from pathlib import Path
from kernels_runtime.memory.spill import SpillDir
root, rank, pools = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
held = [SpillDir(root, rank, pool) for pool in pools]
print("ready", flush=True)
sys.stdin.read()
"""


def _owner(root: Path, rank: int, *pools: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", OWNER, str(root), str(rank), *pools],
                               cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline().strip() == "ready"
    return process


def test_remove_stale_removes_only_dead_ranks_of_the_pool(disk: Path):
    dead, live = _owner(disk, 0, "p1", "p2"), _owner(disk, 1, "p1")
    try:
        dead.send_signal(signal.SIGKILL)  # no exit handlers: its folders stay behind
        dead.wait(timeout=30)
        assert (disk / "p1" / "rank0").is_dir()
        assert remove_stale(disk, "p1") == [disk / "p1" / "rank0"]
        assert (disk / "p1" / "rank1").is_dir() and (disk / "p2" / "rank0").is_dir()
        assert remove_stale(disk, "p1") == []
    finally:
        live.communicate("", timeout=30)  # a normal exit removes its own folder
    assert not (disk / "p1").exists()
    assert remove_stale(disk, "p2") == [disk / "p2" / "rank0"]

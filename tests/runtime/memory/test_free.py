"""Default budgets share the memory that is free (``kernels_runtime/memory/free.py``).

What is protected (issue 26, item 5): a default is a fraction of the memory *free* on a rank's
device or host divided among the ranks sharing it, never a fraction of the total per rank; a
container's cgroup limit counts on a host (``psutil`` sees the machine); bad input says what to
give; and the KV cache, allocated at its default size, costs RSS only as blocks are written.
"""

from __future__ import annotations

import psutil
import pytest
import torch

from kernels_runtime.comm.accelerator import Accelerator
from kernels_runtime.memory import free

GIB = 2**30


def test_a_share_is_the_fraction_of_free_memory_divided_among_the_ranks():
    assert free.share(16 * GIB, 4, 0.5) == 2 * GIB
    assert free.share(16 * GIB, 1, 0.5) == 8 * GIB
    assert free.share(-1, 2, 0.5) == 0  # nothing free is nothing to take
    with pytest.raises(ValueError, match=r"fraction=0: .*\(0, 1\]"):
        free.share(GIB, 1, 0)
    with pytest.raises(ValueError, match="sharing=0"):
        free.share(GIB, 0, 0.5)


def test_local_ranks_reads_the_launchers_count_and_refuses_nonsense(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert free.local_ranks(3) == 3  # no launcher said: every rank here
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert free.local_ranks(8) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='four'.*whole number"):
        free.local_ranks()


def _cgroup(tmp_path, limit: str, usage: int, inactive: int) -> tuple:
    (tmp_path / "max").write_text(limit + "\n")
    (tmp_path / "current").write_text(f"{usage}\n")
    (tmp_path / "stat").write_text(f"anon {usage - inactive}\ninactive_file {inactive}\n")
    return (str(tmp_path / "max"), str(tmp_path / "current"), str(tmp_path / "stat")),


def test_a_cgroup_limit_bounds_the_hosts_free_memory(tmp_path, monkeypatch):
    # 2 GiB limit, 1.5 GiB used of which 0.5 GiB is page cache the kernel drops: 1 GiB free
    monkeypatch.setattr(free, "_CGROUPS", _cgroup(tmp_path, str(2 * GIB), 3 * GIB // 2, GIB // 2))
    assert free.cgroup_free() == GIB
    assert free.host_free() == min(GIB, psutil.virtual_memory().available)
    monkeypatch.setattr(free, "_CGROUPS", _cgroup(tmp_path, "max", GIB, 0))  # v2: no limit
    assert free.cgroup_free() is None
    monkeypatch.setattr(free, "_CGROUPS", _cgroup(tmp_path, str(2**63 - 4096), GIB, 0))  # v1
    assert free.cgroup_free() is None
    monkeypatch.setattr(free, "_CGROUPS", ((str(tmp_path / "absent"),) * 3,))
    assert free.cgroup_free() is None


def test_the_default_budget_on_a_host_divides_its_free_memory_among_its_ranks(monkeypatch):
    host = Accelerator.host()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    got, sharing = free.free_and_sharing(host)
    assert sharing == 4
    assert 0 < got <= psutil.virtual_memory().total
    budget = free.default_budget(host, 0.5)
    # free memory moves with other processes: within the machine's, and a quarter-ish of it
    assert 0 < budget <= psutil.virtual_memory().total // 8
    assert free.default_budget(host, 0.5, want=1234) == 1234  # a smaller wish is kept


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a GPU: the device path asks the device what is free")
def test_the_default_budget_on_a_device_is_its_free_memory_shared_by_its_ranks():
    device = Accelerator.for_backend("nccl")
    free_now, total = device.module.mem_get_info(device.device)
    count = device.module.device_count()
    got, sharing = free.free_and_sharing(device, ranks_here=2 * count)
    assert sharing == 2 and 0 < got <= total
    assert free.default_budget(device, 0.5, ranks_here=2 * count) <= free_now // 4 + 2**26


_RSS_PROBE = """
import json, psutil, torch
from kernels_runtime.inference.kv_cache import LayerShape, PagedKVCache
process = psutil.Process()
layers = [LayerShape(kv_heads=4, head_dim=64)] * 8  # 16 KiB per token over 8 layers
before = process.memory_info().rss
cache = PagedKVCache(layers, num_blocks=1024, block_size=16, dtype=torch.float32,
                     device=torch.device("cpu"))
allocated = process.memory_info().rss - before
for keys, values in (cache.layer(i) for i in range(len(layers))):
    keys[:, : keys.shape[1] // 4].fill_(1.0)
    values[:, : values.shape[1] // 4].fill_(1.0)
print(json.dumps({"nbytes": cache.nbytes, "allocated": allocated,
                  "written": process.memory_info().rss - before}))
"""


def test_the_kv_cache_costs_rss_only_for_the_blocks_written():
    """A cache of 256 MiB (its default size on a small host) adds a few MiB of RSS until its
    blocks are written; writing a quarter of them adds about a quarter. Measured in a fresh
    interpreter: in a long test process the allocator hands out pages freed earlier and still
    resident, so RSS would not move at all."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _RSS_PROBE], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["nbytes"] == 256 * 2**20
    assert got["allocated"] < 32 * 2**20, "the cache was touched whole"
    assert 48 * 2**20 < got["written"] < 112 * 2**20, got["written"] / 2**20

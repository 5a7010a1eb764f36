"""Rates of the offload tiers on this rank: host<->device copies, the spill disk, host memory.

The planner's offload terms divide bytes moved per step by these rates, so they are measured
where the spill files and the host-side optimizer will really be: copies between pinned host
memory and the device (on a CPU-only machine, where "device" and "host" are the same RAM, a
host memcpy: what a move between the two accounts costs if it copies); the spill root's disk by
``kernels_runtime.memory.disk.measure_disk_bandwidth`` (one sequential file, page cache
bypassed, so the rate is the disk's and not RAM's); host memory bandwidth as an fp32 copy
(read + write) on the host, which bounds host-side Adam. Every rank measures at once, as ranks
share the machine's links and disks in training.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kernels_runtime.calibrate.timing import timed


def copy_rate(src: torch.Tensor, dst: torch.Tensor, sync: Callable[[], None],
              window_s: float) -> float:
    """Bytes per second of ``dst.copy_(src)`` (each byte counted once, as PCIe carries it)."""
    return src.numel() * src.element_size() / timed(lambda: dst.copy_(src), sync, window_s)


def disk_rates(spill_dir: str | None, nbytes: int) -> dict[str, float | None]:
    """(write, read) of the spill root's disk; None where no spill folder can be written there
    (a read-only mount), or where the root is on tmpfs/ramfs (RAM: not a disk rate)."""
    from kernels_runtime.memory.disk import measure_disk_bandwidth
    from kernels_runtime.memory.spill import MEMORY_FILESYSTEMS, mount_of, spill_root

    root = spill_root(spill_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        if mount_of(root)[1] in MEMORY_FILESYSTEMS:
            return {"disk_write": None, "disk_read": None, "disk_folder": str(root)}
        write, read = measure_disk_bandwidth(root, nbytes)
    except OSError:
        return {"disk_write": None, "disk_read": None, "disk_folder": str(root)}
    return {"disk_write": write, "disk_read": read, "disk_folder": str(root)}


def transfer_rates(device: torch.device, sync: Callable[[], None], *, pin: bool,
                   window_s: float = 0.05, copy_bytes: int | None = None,
                   disk_bytes: int | None = None, spill_dir: str | None = None) -> dict[str, Any]:
    """``pcie`` (host->device and device->host, the slower direction), ``host_bandwidth``
    (bytes read + written per second by a host fp32 copy) and the disk's ``disk_read`` /
    ``disk_write``, bytes/s. Sizes default to what keeps a CPU calibration short (32 MiB
    copies, 64 MiB file) and to GPU-sized transfers on an accelerator (256 MiB each)."""
    on_device = device.type != "cpu"
    copy_bytes = copy_bytes or (256 if on_device else 32) * 2**20
    disk_bytes = disk_bytes or (256 if on_device else 64) * 2**20
    n = copy_bytes // 4
    host = torch.ones(n, pin_memory=pin and on_device)
    host_dst = torch.empty(n)
    host_rate = 2 * copy_rate(host, host_dst, lambda: None, window_s)  # read + write
    if on_device:
        dev = torch.empty(n, device=device)
        h2d = copy_rate(host, dev, sync, window_s)
        d2h = copy_rate(dev, host, sync, window_s)
        pcie = min(h2d, d2h)
        del dev
    else:
        pcie = host_rate / 2  # a move between the two accounts of one RAM, if it copies
    out: dict[str, Any] = {"pcie": pcie, "host_bandwidth": host_rate}
    out.update(disk_rates(spill_dir, disk_bytes))
    return out

"""Memory a rank may take by default: what is free on its device or host, shared among the ranks
that use the same one.

A default sized from a device's *total* memory takes the machine on a host: there the "device"
is the host's RAM, shared by every rank on it (and by the kernel, the controller and whatever
else runs), so four ranks each taking a quarter of it take all of it (issue 26: 6.8 GB of RSS
per rank for a 135M model). Defaults are therefore a fraction of what is *free now* (after the
caller loaded its weights), divided by the ranks sharing it: ranks of one host share its RAM, and
ranks of one host share its devices when there are more ranks than devices. On a host the free
memory respects a container's cgroup limit (Binder, Kubernetes), since ``psutil`` reads the
machine's. Torch-free: a device is asked through the ``Accelerator`` given.
"""

from __future__ import annotations

import os
from typing import Any

# cgroup v2, then v1: (limit, usage, stat) files of this process's memory group
_CGROUPS = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current",
             "/sys/fs/cgroup/memory.stat"),
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
             "/sys/fs/cgroup/memory/memory.usage_in_bytes",
             "/sys/fs/cgroup/memory/memory.stat"))
_NO_LIMIT = 2**60  # cgroup v1 writes "no limit" as a page-rounded 2**63


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2 writes "max" for no limit


def _reclaimable(stat_path: str) -> int:
    """Page cache the kernel drops before it fails an allocation (inactive file pages), which
    a cgroup's usage counts."""
    try:
        with open(stat_path) as f:
            fields = dict(line.split() for line in f if line.count(" ") == 1)
    except (OSError, ValueError):
        return 0
    for key in ("total_inactive_file", "inactive_file"):
        if fields.get(key, "").isdigit():
            return int(fields[key])
    return 0


def cgroup_free() -> int | None:
    """Bytes this process's memory cgroup can still take (its limit less what it uses, page
    cache it would drop not counted); None when no limit applies."""
    for limit_path, usage_path, stat_path in _CGROUPS:
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is None or usage is None or limit >= _NO_LIMIT:
            continue
        return max(0, limit - max(0, usage - _reclaimable(stat_path)))
    return None


def host_free() -> int:
    """Bytes free for new allocations on this host: ``psutil``'s available memory, or less
    where a cgroup limit is tighter."""
    import psutil

    free = psutil.virtual_memory().available
    limited = cgroup_free()
    return free if limited is None else min(free, limited)


def local_ranks(world: int = 1) -> int:
    """Ranks on this host (``LOCAL_WORLD_SIZE``, which every launcher here exports; else
    ``world``, as if every rank ran here)."""
    text = os.environ.get("LOCAL_WORLD_SIZE") or str(world)
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={text!r}: it must be the number of ranks on this "
                         "host (a whole number >= 1); unset it to count the world as one host")
    return int(text)


def share(free: int, sharing: int, fraction: float) -> int:
    """``fraction`` of ``free`` bytes, divided among ``sharing`` ranks: one rank's default."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction}: give the share of free memory to take, in "
                         "(0, 1], e.g. 0.5")
    if sharing < 1:
        raise ValueError(f"sharing={sharing}: at least this rank uses the memory")
    return int(max(0, free) * fraction) // sharing


def free_and_sharing(accelerator: Any, ranks_here: int | None = None) -> tuple[int, int]:
    """(bytes free on the rank's device, or its host when it has none; ranks sharing them):
    the ranks of a host share its RAM, and its devices when it has fewer devices than ranks."""
    ranks_here = local_ranks() if ranks_here is None else ranks_here
    module = accelerator.module
    if module is None:
        return host_free(), ranks_here
    free, _total = module.mem_get_info(accelerator.device)
    devices = max(1, module.device_count())
    return int(free), max(1, -(-ranks_here // devices))


def default_budget(accelerator: Any, fraction: float, want: int | None = None,
                   ranks_here: int | None = None) -> int:
    """One rank's default budget: ``fraction`` of the memory free on its device (or host) now,
    divided among the ranks sharing it, and no more than ``want`` when given."""
    free, sharing = free_and_sharing(accelerator, ranks_here)
    budget = share(free, sharing, fraction)
    return budget if want is None else min(want, budget)

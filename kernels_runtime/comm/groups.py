"""What the collectives need to know about a process group, looked up once per group.

Every collective names its group in stats and errors, bounds its wait by the group's own
timeout, and behaves differently on a backend whose work is queued on a device (nccl) than on
one that runs on the host (gloo). Those facts never change for a group, and reading them
(private torch attributes, a rank list) costs more than a small collective on a fast link, so
``GroupRegistry`` caches one ``GroupInfo`` per group, weakly: a destroyed group's entry goes
with it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels_runtime.comm.accelerator import HOST_KIND, backend_device_kind

Group = dist.ProcessGroup | None


@dataclass(frozen=True)
class GroupInfo:
    name: str  # "dp", "tp", ... or "ranks0,2" for unnamed groups
    backend: str
    timeout_s: float | None  # the group's own collective timeout, None where unknown
    queued: bool  # work runs on a device stream after the call returns (nccl, xccl)
    member: bool  # this rank belongs to the group


def _timeout_s(group: dist.ProcessGroup, backend: str) -> float | None:
    try:
        device = torch.device(backend_device_kind(backend))
        return group._get_backend(device).options._timeout.total_seconds()
    except Exception:  # private API: absent or shaped differently in other torch versions
        return None


class GroupRegistry:
    """Labels and cached facts of process groups (see the module docstring)."""

    def __init__(self) -> None:
        self._world_name = "world"
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._info: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def name(self, group: Group, label: str) -> None:
        """Label ``group`` ("dp", "tp", ...); None means the default group."""
        pg = dist.group.WORLD if group is None else group
        if pg is dist.group.WORLD:
            self._world_name = label
        else:
            self._names[pg] = label
        if pg is not None:
            self._info.pop(pg, None)

    def label(self, group: Group) -> str:
        return self.info(group).name

    def info(self, group: Group) -> GroupInfo:
        pg = dist.group.WORLD if group is None else group
        found = self._info.get(pg)
        if found is None:
            found = self._info[pg] = self._read(pg)
        return found

    def _read(self, pg: dist.ProcessGroup) -> GroupInfo:
        member = dist.get_rank(pg) >= 0
        if pg is dist.group.WORLD:
            name = self._world_name
        elif pg in self._names:
            name = self._names[pg]
        elif member:
            name = "ranks" + ",".join(map(str, dist.get_process_group_ranks(pg)))
        else:
            name = "non-member"
        backend = dist.get_backend(pg) if member else "none"
        queued = member and backend_device_kind(backend) != HOST_KIND
        timeout = _timeout_s(pg, backend) if member else None
        return GroupInfo(name, backend, timeout, queued, member)

"""Which engine becomes which rank, and whether the hosts can work together at all.

Why it is the pool's job: ipyparallel's engine ids change on every restart and say nothing
about hosts. Ranks are assigned so that the ranks of one host are adjacent (hosts in the order
of the launcher's lowest rank on them, then by name; inside a host by the launcher's rank,
device and engine id): tensor-parallel peers are adjacent ranks (the innermost mesh axis), so
with tp dividing the ranks per host their groups never cross the network. ``local_rank`` is a
rank's index among its host's ranks; it picks the host's device.

A pool whose hosts run different torch or workbench versions would fail later in ways that are
hard to read (unpickling errors, mismatched collectives), so it is refused at start, naming
which host runs what.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
from dataclasses import dataclass
from typing import Any

from workbench.errors import PoolError
from workbench.version import __version__


@dataclass(frozen=True)
class RankLayout:
    """``order[r]``: index (into the identities) of the engine that becomes rank r."""

    order: list[int]
    hosts: list[str]  # per rank
    local_ranks: list[int]
    local_sizes: list[int]

    def ranks_of(self, host: str) -> list[int]:
        return [r for r, h in enumerate(self.hosts) if h == host]


def assign_ranks(idents: list[dict[str, Any]], engine_ids: list[int]) -> RankLayout:
    """Order engines by host, then launcher rank, device and engine id."""
    def launcher_rank(i: int) -> int:
        value = idents[i].get("launcher_rank")
        return -1 if value is None else value

    first: dict[str, int] = {}
    for i, ident in enumerate(idents):
        host = ident["host"]
        first[host] = min(first.get(host, launcher_rank(i)), launcher_rank(i))
    order = sorted(range(len(idents)), key=lambda i: (
        first[idents[i]["host"]], idents[i]["host"], launcher_rank(i), idents[i].get("gpu", ""),
        engine_ids[i]))
    hosts = [idents[i]["host"] for i in order]
    local_ranks = [hosts[:r].count(h) for r, h in enumerate(hosts)]
    local_sizes = [hosts.count(h) for h in hosts]
    return RankLayout(order, hosts, local_ranks, local_sizes)


def check_versions(idents: list[dict[str, Any]], notebook: dict[str, str]) -> None:
    """Refuse engines whose torch or workbench version differs from another's or the
    notebook's (``notebook``: package -> version; a package it lacks is not compared).
    torch's build label is not compared (a CPU build on the login node, ``2.4.0+cpu``, works
    with ``2.4.0+cu121`` on the GPU nodes); its release is."""
    problems = []
    for package in ("torch", "workbench"):
        seen: dict[str, set[str]] = {}
        for ident in idents:
            seen.setdefault(_release(ident.get(package, "missing")), set()).add(ident["host"])
        if package in notebook:
            seen.setdefault(_release(notebook[package]), set()).add("the notebook")
        if len(seen) > 1:
            where = "; ".join(f"{version} on {', '.join(sorted(hosts, key=_notebook_last))}"
                              for version, hosts in sorted(seen.items()))
            problems.append(f"{package}: {where}")
    if problems:
        raise PoolError(
            "the pool's hosts run different versions (" + " | ".join(problems) + "). Install "
            "the same torch and colossal-workbench on every host (e.g. one shared virtualenv "
            "or the same pinned requirements), then start again."
        )


def _release(version: str) -> str:
    return version.split("+", 1)[0]


def _notebook_last(host: str) -> tuple[bool, str]:
    return host == "the notebook", host


def tp_groups_within_hosts(hosts: list[str], tp: int) -> str | None:
    """None when every tensor-parallel group (``tp`` adjacent ranks) is inside one host;
    otherwise why not and what would work."""
    if tp <= 1 or len(set(hosts)) <= 1:
        return None
    for start in range(0, len(hosts), tp):
        group = hosts[start:start + tp]
        if len(set(group)) > 1:
            per_host = sorted({hosts.count(h) for h in hosts})
            return (f"tp={tp} would put ranks {start}..{start + len(group) - 1} on hosts "
                    f"{', '.join(sorted(set(group)))} into one tensor-parallel group, whose "
                    "collectives then cross the network at every layer; choose tp dividing "
                    f"the ranks per host ({', '.join(map(str, per_host))})")
    return None


def rank_devices(gpus: int) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` entry of each local rank: this process's own entries when
    it has some (a JupyterHub spawner or a scheduler may have given it GPU 3 only, and its
    ranks must stay on GPU 3, not take GPU 0 from someone else), else 0..gpus-1."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        listed = [d.strip() for d in visible.split(",") if d.strip() not in ("", "-1")]
        if listed:
            return listed[:gpus]
    return [str(g) for g in range(gpus)]


def visible_gpu_count() -> int:
    """GPUs this host's engines would see, read from the NVIDIA driver without importing torch
    (which costs the notebook over a second at every start); torch decides elsewhere."""
    nvidia = "/proc/driver/nvidia/gpus"
    if not os.path.isdir(nvidia) and not os.path.exists("/dev/kfd"):
        return 0
    if os.path.isdir(nvidia) and not os.path.exists("/dev/kfd"):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        present = len(os.listdir(nvidia))
        if visible is None:
            return present
        return min(present, len([d for d in visible.split(",") if d.strip() not in ("", "-1")]))
    try:  # ROCm and mixed hosts: ask torch
        import torch

        return torch.cuda.device_count()
    except Exception:  # torch missing or broken driver: CPU ranks still work
        return 0


def notebook_versions() -> dict[str, str]:
    """Versions the engines must match (torch read from its metadata: the notebook side never
    imports torch)."""
    versions = {"workbench": __version__}
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        versions["torch"] = importlib.metadata.version("torch")
    return versions

"""One set of process groups per topology, created once per rank session and reused.

Creating a process group is collective and is never undone until the default group is
destroyed, so building a mesh in every notebook cell piles groups up on every rerun. A
``MeshCache`` (one per rank session, carried by its ``Collectives`` as ``comm.meshes``) keeps one
``Mesh`` per axis sizes (the torch ``DeviceMesh`` of the four axes plus the derived groups: dp x
sp, pipeline embedding pairs) and, on it, the 2D/2.5D tensor-parallel sub-grids per mode.

Groups die with the default group: when that is re-created (after an interrupted or timed-out
collective) the cache is emptied, both by the session and by noticing that the default group
is no longer the one its meshes were built on, so no cached mesh ever refers to a dead group.
All ranks build the same meshes in the same order, because every rank builds a context from
the same plan; the groups inside a mesh are created in a fixed order for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kernels_runtime.mesh.plan import AXES
from kernels_runtime.mesh.topology import Ranks, Topology


def new_groups(lists: list[Ranks]) -> dist.ProcessGroup | None:
    """Create one group per rank list (collective: every rank creates every group, in order);
    return the one holding this rank."""
    rank, mine = dist.get_rank(), None
    for members in lists:
        group = dist.new_group(list(members))
        if rank in members:
            mine = group
    return mine


@dataclass
class Mesh:
    """The process groups of one (dp, pp, sp, tp) grid on this rank."""

    topology: Topology  # of 1d mode: the grid, without the tp sub-grid
    device_mesh: DeviceMesh
    groups: dict[str, dist.ProcessGroup]  # dp, pp, sp, tp, dp_sp, embedding (where they exist)
    grids: dict[tuple[str, int], dict[str, dist.ProcessGroup]] = field(default_factory=dict)
    experts: dict[int, dict[str, dist.ProcessGroup]] = field(default_factory=dict)  # by ep

    @classmethod
    def create(cls, topology: Topology, device_type: str) -> Mesh:
        device_mesh = init_device_mesh(device_type, topology.sizes, mesh_dim_names=AXES)
        groups = {axis: device_mesh.get_group(axis) for axis in AXES}
        if topology.dp > 1 and topology.sp > 1:
            groups["dp_sp"] = new_groups(topology.groups_along(("dp", "sp")))
        else:  # gradients of replicated parameters reduce over dp x sp: here one of the two
            groups["dp_sp"] = groups["sp" if topology.sp > 1 else "dp"]
        embedding = topology.embedding_groups()
        if embedding:
            found = new_groups(embedding)
            if found is not None:
                groups["embedding"] = found
        return cls(topology, device_mesh, groups)

    def tp_grid(self, mode: str, depth: int) -> dict[str, dist.ProcessGroup]:
        """The row/column(/depth) groups of a 2D or 2.5D tp grid, created on first use (every
        rank builds the same context, so every rank gets here together)."""
        key = (mode, depth)
        if key not in self.grids:
            topo = Topology(*self.topology.sizes, tp_mode=mode, tp_depth=depth)
            self.grids[key] = {name: new_groups(lists)
                               for name, lists in topo.tp_grid_groups().items()}
        return self.grids[key]

    def expert_groups(self, ep: int) -> dict[str, dist.ProcessGroup]:
        """The "ep" and "edp" groups of expert parallelism of size ``ep``, created on first use
        (every rank builds the same context, so every rank gets here together)."""
        if ep not in self.experts:
            topo = Topology(*self.topology.sizes, ep=ep)
            self.experts[ep] = {name: new_groups(lists)
                                for name, lists in topo.expert_groups().items()}
        return self.experts[ep]

    def all_groups(self) -> list[dist.ProcessGroup]:
        out = [*self.groups.values()]
        for extra in (*self.grids.values(), *self.experts.values()):
            out.extend(extra.values())
        return out


class MeshCache:
    """``Mesh`` per axis sizes, valid while the default group it was built on lives."""

    def __init__(self) -> None:
        self._meshes: dict[tuple[tuple[int, ...], str], Mesh] = {}
        self._world: dist.ProcessGroup | None = None

    def get(self, topology: Topology, device_type: str) -> Mesh:
        if self._world is not dist.group.WORLD:
            self.clear()
            self._world = dist.group.WORLD
        key = (topology.sizes, device_type)
        mesh = self._meshes.get(key)
        if mesh is None:
            base = Topology(*topology.sizes)
            mesh = self._meshes[key] = Mesh.create(base, device_type)
        return mesh

    def clear(self) -> None:
        """Forget every mesh (their groups are dead or about to be)."""
        self._meshes.clear()
        self._world = None

    def meshes(self) -> list[Mesh]:
        return list(self._meshes.values())

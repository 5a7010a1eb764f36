"""``ParallelContext``: a validated Plan turned into process groups on this rank.

The whole dp x pp x sp x tp topology (``topology.py``) is one torch ``DeviceMesh`` with named
axes, tp innermost, plus the groups the strategies derive from it, so a rank's coordinates and
every group it communicates in come from one object that is passed explicitly to every
strategy: no module-level state. The groups it owns:

| name                      | ranks that differ only in       | used for                       |
|---------------------------|---------------------------------|--------------------------------|
| dp, pp, sp, tp            | that axis                       | the four parallel dimensions   |
| dp_sp                     | dp and sp                       | replicated gradients under sp  |
| tp_row, tp_col (, tp_dep) | a row / column (/ depth) of tp  | 2D SUMMA, 2.5D Tesseract       |
| embedding                 | pp: first and last stage only   | tied input/output embeddings   |
| ep, edp (ep > 1)          | dp: a run of ep / a stride of ep| expert parallelism: experts    |
|                           |                                 | split / their gradients reduced|

plus ``pp_prev`` / ``pp_next``, the global ranks of the neighbouring pipeline stages. Groups
are cached per axis sizes in the session's ``MeshCache`` (``comm.meshes``): rebuilding a context
for the same plan, or another plan with the same sizes, creates no new group.

``ctx.telemetry`` is the telemetry carried by ``ctx.comm``: in a pool that is the session's
(published to the notebook), under torchrun ``RankSession.from_env()``'s. It comes through the
collectives rather than as another argument because the communication it reports is those
collectives' own: the two can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from kernels_runtime.comm import Accelerator, Collectives, init_single_process
from kernels_runtime.mesh.cache import MeshCache
from kernels_runtime.mesh.plan import AXES, Plan
from kernels_runtime.mesh.topology import Topology
from kernels_runtime.telemetry import Telemetry


@dataclass
class ParallelContext:
    plan: Plan  # validated: dp is resolved
    mesh: DeviceMesh
    comm: Collectives
    device: torch.device
    coords: dict[str, int] = field(default_factory=dict)
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    topology: Topology | None = None
    pp_prev: int | None = None
    pp_next: int | None = None
    sp_folded: int = 1  # > 1: a data view with the sp axis folded into dp (``fold_sp``)

    @classmethod
    def build(
        cls, plan: Plan | str, comm: Collectives | None = None, device: torch.device | None = None
    ) -> ParallelContext:
        """The context of ``plan`` on the initialised default process group (collective: every
        rank must call it with the same plan). Pass the session's ``comm`` to reuse its cached
        groups; without one, a new ``Collectives`` (and new groups) is made. In a plain process
        (no group yet) a plan of one rank gets a private group of one (``join_single_process``)."""
        plan = Plan.parse(plan)
        if not dist.is_initialized():
            join_single_process(plan)
        plan = plan.validate(dist.get_world_size())
        if device is None:
            device = Accelerator.for_backend(dist.get_backend()).device
        comm = comm if comm is not None else Collectives()
        if comm.meshes is None:
            comm.meshes = MeshCache()
        topology = Topology.of(plan)
        mesh = comm.meshes.get(topology, device.type)
        groups = dict(mesh.groups)
        if plan.tp_mode != "1d":
            groups.update(mesh.tp_grid(plan.tp_mode, plan.tp_depth))
        if plan.ep > 1:
            groups.update(mesh.expert_groups(plan.ep))
        for name, group in groups.items():
            comm.name_group(group, name)
        for axis in AXES:  # an axis group shared with a derived one keeps the axis name
            comm.name_group(groups[axis], axis)
        rank = dist.get_rank()
        prev, nxt = topology.pp_neighbours(rank)
        return cls(plan=plan, mesh=mesh.device_mesh, comm=comm, device=device,
                   coords=topology.coords(rank), groups=groups, topology=topology,
                   pp_prev=prev, pp_next=nxt)

    def with_plan(self, plan: Plan | str) -> ParallelContext:
        """The same groups under another plan with the same axis sizes and tp mode (e.g.
        another zero stage or precision)."""
        plan = Plan.parse(plan).validate(self.world_size)
        same = ("tp_mode", "tp_depth", "ep", *AXES)
        if any(getattr(plan, a) != getattr(self.plan, a) for a in same):
            raise ValueError(f"plan {plan.to_string()!r} needs another mesh than "
                             f"{self.plan.to_string()!r}; build a new ParallelContext")
        return ParallelContext(plan, self.mesh, self.comm, self.device, dict(self.coords),
                               dict(self.groups), self.topology, self.pp_prev, self.pp_next)

    def fold_sp(self) -> ParallelContext:
        """The context data parallelism sees under sequence parallelism (sp > 1): sp ranks hold
        the same parameters and each computes a part of the gradient (its tokens'), so dp x sp
        is one data axis: ZeRO shards over it and averages gradients over it, and the norm and
        checkpoints count its replicas once. (Each sp rank's gradient of the sequence-split
        part is scaled by sp where the sequence is joined, so the average is their sum.)"""
        sp = self.size("sp")
        if sp == 1:
            return self
        group = self.group("dp_sp")
        plan = replace(self.plan, dp=self.size("dp") * sp, sp=1, sp_mode="none")
        coords = dict(self.coords, dp=dist.get_group_rank(group, dist.get_rank()), sp=0)
        return ParallelContext(plan, self.mesh, self.comm, self.device, coords,
                               dict(self.groups, dp=group), self.topology, self.pp_prev,
                               self.pp_next, sp_folded=sp)

    def data_mesh(self) -> DeviceMesh:
        """The 1D device mesh of the data axis (dp, or dp x sp flattened in a folded view)."""
        if self.sp_folded == 1:
            return self.mesh["dp"]
        return self.mesh["dp", "sp"]._flatten("dp_sp")

    @property
    def telemetry(self) -> Telemetry:
        """Where ``train_step`` records steps (see the module docstring)."""
        return self.comm.telemetry

    # ---- groups and coordinates -----------------------------------------------------------
    def group(self, name: str) -> dist.ProcessGroup:
        """The group called ``name`` (an axis, or a derived group; module docstring)."""
        try:
            return self.groups[name]
        except KeyError:
            raise KeyError(f"this context has no group {name!r} under plan "
                           f"{self.plan.to_string()!r}; it has {sorted(self.groups)}") from None

    def span_group(self, axes: tuple[str, ...] | set[str]) -> dist.ProcessGroup | None:
        """The smallest group spanning ``axes`` where their size exceeds 1: None when no axis
        does (nothing to reduce), the axis group for one, dp_sp for dp and sp, else the world."""
        live = {a for a in axes if self.size(a) > 1}
        if not live:
            return None
        if len(live) == 1:
            return self.group(live.pop())
        if live == {"dp", "sp"}:
            return self.group("dp_sp")
        return dist.group.WORLD

    def size(self, axis: str) -> int:
        return getattr(self.plan, axis)

    def coord(self, axis: str) -> int:
        return self.coords[axis]

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.group("dp")

    @property
    def dp_size(self) -> int:
        return self.size("dp")

    @property
    def dp_rank(self) -> int:
        return self.coord("dp")

    @property
    def is_first_stage(self) -> bool:
        return self.coord("pp") == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord("pp") == self.size("pp") - 1

    def describe(self) -> str:
        where = " ".join(f"{a}={self.coords[a]}/{self.size(a)}" for a in AXES)
        return f"rank {self.rank}: {where} on {self.device}"


def join_single_process(plan: Plan) -> None:
    """Give a plain Python process (no pool, no torchrun) a private group of one rank when
    ``plan`` needs only one, so ``Engine(model)`` or ``parallelize(model, opt, "zero=0")``
    runs there as it would on a pool of one rank; a plan needing more ranks cannot, and says
    where to get them. An impossible plan is refused before any group is made."""
    ranks = plan.ranks
    if ranks > 1:
        raise RuntimeError(
            f"plan {plan.to_string()!r} needs {ranks} ranks, but this process runs alone (no "
            f"torch.distributed group): start a pool of {ranks} ranks (`%colossal start -n "
            f"{ranks}`) and run it in a %%colossal cell, or run the script under `torchrun "
            f"--nproc-per-node {ranks}` with kernels_runtime.session.RankSession.from_env()")
    plan.validate(1)
    init_single_process()

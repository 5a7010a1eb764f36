"""``ParallelContext``: a validated Plan turned into process groups on this rank.

The whole dp x pp x sp x tp topology is one torch ``DeviceMesh`` with named axes (outermost
first), so a rank's coordinates and the group of every axis come from one object that is passed
explicitly to every strategy: no module-level state. Axis order puts tp innermost so tensor-
parallel peers are adjacent ranks (same node, fastest links), then sp, pp, and dp outermost.

``ctx.telemetry`` is the telemetry carried by ``ctx.comm``: in a pool that is the session's
(published to the notebook), under torchrun ``RankSession.from_env()``'s. It comes through the
collectives rather than as another argument because the communication it reports is those
collectives' own: the two can never disagree, and ``ParallelContext.build(plan, comm)`` in
existing notebooks picks it up unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kernels_runtime.comm import Collectives
from kernels_runtime.mesh.plan import AXES, Plan
from kernels_runtime.telemetry import Telemetry


@dataclass
class ParallelContext:
    plan: Plan  # validated: dp is resolved
    mesh: DeviceMesh
    comm: Collectives
    device: torch.device
    coords: dict[str, int] = field(default_factory=dict)

    @classmethod
    def build(
        cls, plan: Plan | str, comm: Collectives | None = None, device: torch.device | None = None
    ) -> ParallelContext:
        """Create the mesh for ``plan`` on the initialised default process group (collective:
        every rank must call it with the same plan)."""
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: start a pool (`%colossal start`) or run "
                "under torchrun and call kernels_runtime.session.RankSession.from_env() first"
            )
        world = dist.get_world_size()
        plan = Plan.parse(plan).validate(world)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if dist.get_backend() == "nccl" else torch.device("cpu")
        shape = tuple(getattr(plan, axis) for axis in AXES)  # (dp, pp, sp, tp)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=AXES)
        comm = comm if comm is not None else Collectives()
        for axis in AXES:
            comm.name_group(mesh.get_group(axis), axis)
        coords = {axis: mesh.get_local_rank(axis) for axis in AXES}
        return cls(plan=plan, mesh=mesh, comm=comm, device=device, coords=coords)

    def with_plan(self, plan: Plan | str) -> ParallelContext:
        """The same mesh under another plan with the same axis sizes (e.g. another zero stage
        or precision): no new process groups."""
        plan = Plan.parse(plan).validate(self.world_size)
        if any(getattr(plan, a) != getattr(self.plan, a) for a in AXES):
            raise ValueError(f"plan {plan.to_string()!r} needs another mesh than "
                             f"{self.plan.to_string()!r}; build a new ParallelContext")
        return ParallelContext(plan, self.mesh, self.comm, self.device, dict(self.coords))

    @property
    def telemetry(self) -> Telemetry:
        """Where ``train_step`` records steps (see the module docstring)."""
        return self.comm.telemetry

    # ---- per-axis facts ------------------------------------------------------------------
    def group(self, axis: str) -> dist.ProcessGroup:
        return self.mesh.get_group(axis)

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

    def describe(self) -> str:
        where = " ".join(f"{a}={self.coords[a]}/{self.size(a)}" for a in AXES)
        return f"rank {self.rank}: {where} on {self.device}"

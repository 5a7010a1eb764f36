"""Which ipyparallel launcher starts the engines, and where the controller listens.

We never build our own cluster manager: multi-node pools use ipyparallel's launchers (MPI,
Slurm, SSH, PBS, ...). Security rule: the controller binds 127.0.0.1 unless the user names
another address. Launchers that put engines on other hosts cannot reach a loopback controller,
so for them the address is required and must be given explicitly, never guessed, because
binding beyond loopback exposes the controller to the network (its traffic is authenticated
with an HMAC key but not encrypted unless CurveZMQ is enabled with IPP_ENABLE_CURVE=1).
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.errors import PoolError

LOCAL_LAUNCHERS = ("local", "mpi")
REMOTE_LAUNCHERS = ("ssh", "slurm", "pbs", "sge", "lsf", "htcondor")
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class LauncherSpec:
    engines: str
    controller_ip: str

    @property
    def remote(self) -> bool:
        return self.engines in REMOTE_LAUNCHERS


def resolve_launcher(name: str, controller_ip: str | None) -> LauncherSpec:
    """Check a launcher name and the controller address it needs."""
    name = (name or "local").lower()
    if name not in LOCAL_LAUNCHERS + REMOTE_LAUNCHERS:
        known = ", ".join(LOCAL_LAUNCHERS + REMOTE_LAUNCHERS)
        raise PoolError(f"unknown launcher {name!r}; choose one of: {known}")
    if name in REMOTE_LAUNCHERS and not controller_ip:
        raise PoolError(
            f"launcher {name!r} starts engines on other hosts, which cannot reach a controller on "
            f"{LOOPBACK}. Pass the address they should connect to explicitly, e.g. "
            f"Pool(launcher={name!r}, controller_ip='10.0.0.5') or "
            f"`%colossal start --launcher {name} --controller-ip 10.0.0.5`; consider "
            "IPP_ENABLE_CURVE=1 to encrypt controller traffic."
        )
    return LauncherSpec(engines=name, controller_ip=controller_ip or LOOPBACK)

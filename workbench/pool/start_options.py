"""Where a pool starts: the options ``%colossal start`` and ``workbench run`` share.

Why it exists: ``workbench run NB --launcher slurm -n 4`` must start the notebook's pool where
the command line says without editing the notebook. The options are declared here once, as
plain ``(flags, settings)`` pairs (no IPython import, so the ``workbench`` command starts fast);
``workbench.magics`` turns them into its ``%colossal start`` arguments and ``workbench.cli``
adds them to ``run``'s parser, so both spell and document them the same way.

How the command line reaches the notebook: ``workbench run`` writes its options, as the user
would type them after ``%colossal start``, into ``$WORKBENCH_START_OPTIONS`` of the kernel it
starts. ``%colossal start`` (and ``restart`` without a pool) read them after the line's own
options, so they win over the notebook's (``-n 4`` over the notebook's ``-n 2``; argparse keeps
the last value), and ``--launcher-option`` values add to the line's. The notebook file is left
as it is; a kernel started any other way has no such variable and nothing changes.
"""

from __future__ import annotations

import argparse
import os
import shlex
from typing import Any

ENV = "WORKBENCH_START_OPTIONS"

# (flags, add_argument settings); the order is the help's
LAUNCH_OPTIONS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("-n", "--ranks"), dict(type=int, default=None, dest="n",
                             help="number of ranks (default: one per GPU, else 2 CPU ranks)")),
    (("--backend",), dict(choices=("gloo", "nccl"), default=None)),
    (("--launcher",), dict(default="local",
                           help="ipyparallel engine launcher: local, mpi, slurm, ssh, ...")),
    (("--controller-ip",), dict(default=None, help="address the controller binds to "
                                "(required for remote launchers)")),
    (("--hosts",), dict(default=None, help="ssh launcher: engines per host, e.g. "
                        "node1:2,node2:2")),
    (("--launcher-option",), dict(action="append", default=[], dest="launcher_options",
                                  help="repeatable; slurm: an sbatch option "
                                  "(--launcher-option=--partition=gpu), mpi: an mpiexec "
                                  "argument")),
    (("--start-timeout",), dict(type=float, default=None,
                                help="seconds start/restart wait for engines, a queued Slurm "
                                "job included (default 120)")),
]


def add_launch_options(parser: argparse.ArgumentParser | Any) -> None:
    """Add the shared options to an argparse parser (or argument group)."""
    for flags, settings in LAUNCH_OPTIONS:
        parser.add_argument(*flags, **settings)


def _quote(value: str) -> str:
    # IPython's magic splitter keeps quotes (the magic strips them), so quote only when needed
    return shlex.quote(value) if any(c.isspace() for c in value) else value


def to_line(args: argparse.Namespace, nodes: int | None = None) -> str:
    """The options of ``args`` that differ from their defaults, as ``%colossal start`` takes
    them; ``nodes`` (Slurm only) becomes the sbatch option ``--nodes=N``."""
    words: list[str] = []
    for flags, settings in LAUNCH_OPTIONS:
        name = flags[0]  # as typed after %colossal start: -n, not --ranks
        value = getattr(args, settings.get("dest", flags[-1].lstrip("-").replace("-", "_")))
        if settings.get("action") == "append":
            words += [f"{name}={_quote(v)}" for v in value]
        elif value != settings.get("default"):
            words += [name, _quote(str(value))]
    if nodes is not None:
        if args.launcher != "slurm":
            raise ValueError(f"--nodes {nodes}: only --launcher slurm places ranks on a number "
                             "of nodes; for ssh list the hosts (--hosts node1:2,node2:2), for "
                             "mpi give a hostfile (--launcher-option=--hostfile=FILE)")
        if nodes < 1:
            raise ValueError(f"--nodes {nodes}: give at least 1")
        words.append(f"--launcher-option=--nodes={nodes}")
    return " ".join(words)


def with_env_options(line: str, environ: dict[str, str] | None = None) -> str:
    """``line`` (a ``%colossal`` start or restart line) followed by ``$WORKBENCH_START_OPTIONS``
    (the module doc says why)."""
    extra = (os.environ if environ is None else environ).get(ENV, "").strip()
    return f"{line} {extra}" if extra else line

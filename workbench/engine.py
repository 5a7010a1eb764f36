"""The engine process's entry point: ``python -m workbench.engine [ipengine arguments]``.

Why it exists: most of a pool's start is every rank importing torch (about 1.3 s of CPU per
process). ipyparallel's own entry (``python -m ipyparallel.engine``) would import it only when
the pool's first call arrives, after the controller is up and the engine has registered, so
the import waits on both. This entry imports the rank runtime first and then runs
ipyparallel's engine unchanged (same arguments, ``--mpi`` included), so the import overlaps
the controller's start and the registration round trips. Every launcher (local, MPI, Slurm,
SSH) starts engines through it.

It also refuses early, in words, an engine host without torch (the pool would otherwise see
only an engine that never registers), and creates the IPython profile folder the engine is
told to use when this host lacks it: a batch job's engines on another node run under that
node's HOME, which need not hold the notebook's profile (ipyparallel's SSH launcher creates it
remotely; its Slurm launcher assumes a shared HOME).
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    try:
        import kernels_runtime.session  # noqa: F401  torch, torch.distributed, the runtime
    except ImportError as e:  # shown in the engine log the pool's start error points to
        sys.exit(f"workbench engine: cannot import the rank runtime ({e}); install "
                 "colossal-workbench and torch on this host with the notebook's versions")
    _ensure_profile_dir(sys.argv[1:])
    from ipyparallel.engine.app import main as engine_main

    engine_main()


def _ensure_profile_dir(argv: list[str]) -> None:
    location = os.environ.get("IPP_PROFILE_DIR", "")
    for arg in argv:
        if arg.startswith("--profile-dir="):
            location = arg.split("=", 1)[1]
    if location and not os.path.isdir(os.path.expanduser(location)):
        from IPython.core.profiledir import ProfileDir

        ProfileDir.create_profile_dir(os.path.expanduser(location))


if __name__ == "__main__":
    main()

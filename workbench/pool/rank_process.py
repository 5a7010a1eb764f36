"""The engine process's entry point: ``python -m workbench.pool.rank_process [ipengine arguments]``.

Why it exists: most of a pool's start is every rank importing torch (about 1.3 s of CPU per
process). ipyparallel's own entry (``python -m ipyparallel.engine``) would import it only when
the pool's first call arrives, after the controller is up and the engine has registered, so
the import waits on both. This entry imports the rank runtime first and then runs
ipyparallel's engine unchanged (same arguments, ``--mpi`` included), so the import overlaps
the controller's start and the registration round trips. Every launcher (local, MPI, Slurm,
SSH) starts engines through it; with ``--workbench-fork=N`` (the local launcher,
``workbench.pool.forked_ranks``) it forks N engines after the import instead of running one, as
torch's DataLoader forks its workers: the parent only imports, then waits.

It also refuses early, in words, an engine host without torch (the pool would otherwise see
only an engine that never registers), and creates the IPython profile folder the engine is
told to use when this host lacks it: a batch job's engines on another node run under that
node's HOME, which need not hold the notebook's profile (ipyparallel's SSH launcher creates it
remotely; its Slurm launcher assumes a shared HOME).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
import time
from typing import Any

# Seconds an engine asked to stop may take (a cell that ignores the stop) before it exits
# regardless, and a forked parent waits for its engines before SIGKILLing them.
STOP_GRACE_S = 5.0


def main() -> None:
    try:
        import kernels_runtime.session  # noqa: F401  torch, torch.distributed, the runtime
    except ImportError as e:  # shown in the engine log the pool's start error points to
        sys.exit(f"workbench engine: cannot import the rank runtime ({e}); install "
                 "colossal-workbench and torch on this host with the notebook's versions")
    _ensure_profile_dir(sys.argv[1:])
    from ipyparallel.engine.app import IPEngine
    from ipyparallel.engine.app import main as engine_main

    _stop_even_in_a_cell(IPEngine)

    forks = [a for a in sys.argv[1:] if a.startswith("--workbench-")]
    if not forks:
        engine_main()
        return
    sys.argv = [a for a in sys.argv if a not in forks]
    options = dict(a[len("--workbench-"):].split("=", 1) for a in forks)
    devices = [d for d in options.get("devices", "").split(",") if d]
    _fork_engines(int(options["fork"]), devices, engine_main)


def _stop_even_in_a_cell(engine_class: Any) -> None:
    """Make SIGTERM end the engine even while a cell blocks its main thread.

    ipyparallel's handler only queues a stop on the engine's event loop, which a running cell
    (a training loop, a serving loop) never yields to, so a stopped pool's engines lived on.
    Ours also raises ``SystemExit`` in the cell when one runs (the stop then happens as the
    cell unwinds) and arms a backstop that ends the process with ``os._exit`` after
    ``STOP_GRACE_S`` whatever the cell does (a C call that never returns included).
    """
    original = engine_class.init_signal

    def init_signal(self: Any) -> None:
        original(self)
        queue_stop = signal.getsignal(signal.SIGTERM)

        def on_sigterm(sig: int, frame: Any) -> None:
            _arm_backstop(128 + sig)
            if callable(queue_stop):
                queue_stop(sig, frame)
            if _in_a_cell(frame):
                raise SystemExit(128 + sig)

        signal.signal(signal.SIGTERM, on_sigterm)

    engine_class.init_signal = init_signal


def _in_a_cell(frame: Any) -> bool:
    """Whether the main thread was running an apply request (a cell) when the signal came."""
    while frame is not None:
        if frame.f_code.co_name in ("do_apply", "run_cell", "run_code"):
            return True
        frame = frame.f_back
    return False


def _arm_backstop(code: int) -> None:
    def exit_later() -> None:
        time.sleep(STOP_GRACE_S)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    threading.Thread(target=exit_later, name="stop-backstop", daemon=True).start()


def _fork_engines(n: int, devices: list[str], engine_main: Any) -> None:
    """Fork ``n`` engines from this process (see ``workbench.pool.forked_ranks``), forward stop
    signals to them, SIGKILL those still alive ``STOP_GRACE_S`` after a stop (or after this
    process's own parent died) and record how each one ended."""
    import ipykernel.ipkernel  # noqa: F401  imported once here, shared by every child
    import ipyparallel.engine.kernel  # noqa: F401

    from workbench.pool.forked_ranks import exits_file

    children: set[int] = set()
    for i in range(n):
        pid = os.fork()
        if pid == 0:  # the child: an ordinary engine that dies with its parent
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            if devices:
                os.environ["CUDA_VISIBLE_DEVICES"] = devices[i % len(devices)]
            code = 0
            try:
                engine_main()
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
        children.add(pid)

    parent = os.getppid()
    kill_at = [float("inf")]  # when the children still alive get SIGKILL

    def signal_children(sig: int) -> None:
        for child in list(children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, sig)

    def forward(sig: int, frame: Any) -> None:
        signal_children(sig)
        if sig == signal.SIGTERM:
            kill_at[0] = min(kill_at[0], time.monotonic() + STOP_GRACE_S)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    record = exits_file(os.environ.get("IPP_PROFILE_DIR", "."),
                        os.environ.get("IPP_CLUSTER_ID", "engines"))
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:  # none ended: check our parent and the SIGKILL deadline, then poll again
            if os.getppid() != parent and kill_at[0] == float("inf"):
                forward(signal.SIGTERM, None)  # the pool's owner died without stopping us
            if time.monotonic() >= kill_at[0]:
                signal_children(signal.SIGKILL)
            time.sleep(0.1)
            continue
        children.discard(pid)
        with contextlib.suppress(OSError), open(record, "a") as f:
            f.write(json.dumps({"pid": pid, "exit_code": os.waitstatus_to_exitcode(status)})
                    + "\n")


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

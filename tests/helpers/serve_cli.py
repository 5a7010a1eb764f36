"""``workbench serve`` as a user runs it: a real subprocess on a free loopback port, used once its
``/health`` answers, stopped with SIGINT (the CLI drains, then exits 0)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx


@dataclass
class Served:
    url: str  # http://127.0.0.1:PORT
    port: int
    proc: subprocess.Popen
    output: str = ""  # everything it printed, once it exited


_PORT_TAKEN = "address already in use"


def _start(args: tuple[str, ...], start_timeout_s: float) -> Served:
    """One start on a fresh free port; ``Served.proc`` has exited if the start failed."""
    from workbench.serving.server import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "serve", *args, "--port",
                             str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    served = Served(f"http://127.0.0.1:{port}", port, proc)
    deadline = time.monotonic() + start_timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(served.url + "/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    return served


@contextlib.contextmanager
def workbench_serve(*args: str, start_timeout_s: float = 240.0,
                    attempts: int = 3) -> Iterator[Served]:
    """Run ``workbench serve ARGS --port P``; after the block, SIGINT and its whole output.

    The free port is found before the server binds it, so another process may take it in
    between: a start that failed only with "Address already in use" is retried on a new port."""
    for attempt in range(attempts):
        served = _start(args, start_timeout_s)
        if served.proc.poll() is None:
            break
        output = served.proc.stdout.read() if served.proc.stdout else ""
        if _PORT_TAKEN not in output.lower() or attempt + 1 == attempts:
            raise AssertionError(output)
    proc = served.proc
    try:
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        served.output, _ = proc.communicate(timeout=120)

"""A real JupyterLab server in a subprocess, started the way users start it: ``workbench lab``.

Everything it writes (runtime files, the pool-state files of its kernels, workspaces,
settings) goes under one temporary folder, so tests neither see nor leave anything in the
user's Jupyter directories. Token auth, a free port on 127.0.0.1.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class LabServer:
    port: int
    token: str
    root: Path
    runtime_dir: Path
    proc: subprocess.Popen
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request(self, method: str, path: str, body: Any = None, token: bool = True,
                timeout: float = 180.0) -> Response:
        """One HTTP request, redirects not followed; ``token=False`` sends no credentials."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        headers = {"Authorization": f"token {self.token}"} if token else {}
        data = None if body is None else json.dumps(body).encode()
        if data is not None:
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, path, body=data, headers=headers)
            r = conn.getresponse()
            return Response(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
        finally:
            conn.close()

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def start_lab(tmp: Path, copy_notebooks: bool = False, timeout_s: float = 90.0) -> LabServer:
    """``workbench lab --no-browser`` on ``tmp/root`` (a copy of notebooks/ if asked, so
    the UI never writes into the committed notebooks)."""
    root = tmp / "root"
    if copy_notebooks:
        shutil.copytree(NOTEBOOKS, root, ignore=shutil.ignore_patterns("checkpoints", ".*"))
    else:
        root.mkdir(parents=True, exist_ok=True)
    runtime = tmp / "runtime"
    env = dict(
        os.environ, JUPYTER_RUNTIME_DIR=str(runtime), JUPYTER_DATA_DIR=str(tmp / "data"),
        IPP_NONINTERACTIVE="1",
        JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
        JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"), PYTHONUNBUFFERED="1",
    )
    port, token = free_port(), secrets.token_hex(16)
    log = tmp / "lab.log"
    cmd = [sys.executable, "-m", "workbench.cli", "lab", "--no-browser", "--port", str(port),
           "--notebook-dir", str(root), f"--IdentityProvider.token={token}",
           "--ServerApp.ip=127.0.0.1",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    server = LabServer(port, token, root, runtime, proc, log)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"workbench lab exited with {proc.returncode}:\n"
                               f"{server.log_tail()}")
        try:
            if server.request("GET", "/api/status", timeout=2).status == 200:
                return server
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_lab(server)
            raise RuntimeError(f"workbench lab did not answer within {timeout_s} s:\n"
                               f"{server.log_tail()}")
        time.sleep(0.25)


def stop_lab(server: LabServer, timeout_s: float = 30.0) -> None:
    """SIGTERM (Jupyter shuts its kernels down, which stop their pools), then SIGKILL."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait(10)

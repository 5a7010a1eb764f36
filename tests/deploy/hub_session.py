"""A real JupyterHub from deploy/jupyterhub/jupyterhub_config.py, and clients that talk to it
the way a browser does: through the hub's proxy, with a user's token.

Why it exists: tests/deploy/test_hub_server.py checks the playground end to end (users log in,
get servers, run the quickstart over the kernel websocket, cannot reach each other); this file
holds the plumbing so the test reads as the properties it protects.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import websocket

from helpers.jupyter import free_port

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "jupyterhub" / "jupyterhub_config.py"
PASSWORD = "playground-test"


@dataclass
class Hub:
    """A running ``jupyterhub`` process (own session: its proxy and services die with it)."""

    workdir: Path
    devices: str = "0,1"
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    url: str = ""
    api_url: str = ""

    def start(self, timeout_s: float = 60.0) -> Hub:
        port, hub_port, api_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.api_url = f"http://127.0.0.1:{hub_port}/hub/api"  # in every server's environment
        bindir = Path(sys.executable).parent
        env = {**os.environ, **self.env,
               "PATH": os.pathsep.join([str(bindir), os.environ.get("PATH", "")]),
               "WORKBENCH_HUB_DUMMY_PASSWORD": PASSWORD,
               "WORKBENCH_HUB_HOMES": str(self.workdir / "homes"),
               "WORKBENCH_HUB_DEVICES": self.devices}
        env.pop("CUDA_VISIBLE_DEVICES", None)
        self.log = self.workdir / "hub.log"
        self.proc = subprocess.Popen(
            [str(bindir / "jupyterhub"), "-f", str(CONFIG),
             f"--JupyterHub.bind_url={self.url}", f"--JupyterHub.hub_port={hub_port}",
             f"--ConfigurableHTTPProxy.api_url=http://127.0.0.1:{api_port}",
             f"--JupyterHub.db_url=sqlite:///{self.workdir / 'hub.sqlite'}",
             f"--JupyterHub.cookie_secret_file={self.workdir / 'cookie_secret'}",
             f"--ConfigurableHTTPProxy.pid_file={self.workdir / 'proxy.pid'}"],
            cwd=self.workdir, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
            start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if requests.get(f"{self.url}/hub/api/", timeout=10).status_code == 200:
                    return self
            except requests.ConnectionError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the hub did not start; its log:\n{self.tail()}")
            time.sleep(0.3)

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM: the hub stops every server (cleanup_servers), then its proxy."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def login(self, name: str) -> User:
        """Log in through the hub's login form (as a browser does), then ask the hub's REST
        API for a token with that session."""
        s = requests.Session()
        s.get(f"{self.url}/hub/login", timeout=90).raise_for_status()
        xsrf = s.cookies.get("_xsrf")
        r = s.post(f"{self.url}/hub/login?next=", timeout=90, allow_redirects=False,
                   data={"username": name, "password": PASSWORD, "_xsrf": xsrf})
        assert r.status_code == 302, (r.status_code, r.text[:500])
        # the login started a new session, with a new XSRF token: a page of the hub sets it
        s.get(f"{self.url}/hub/home", timeout=90).raise_for_status()
        xsrf = [c.value for c in s.cookies if c.name == "_xsrf"][-1]
        r = s.post(f"{self.url}/hub/api/users/{name}/tokens", timeout=90,
                   headers={"X-XSRFToken": xsrf}, json={"note": "test", "expires_in": 3600})
        assert r.status_code == 201, (r.status_code, r.text[:500])
        return User(self, name, r.json()["token"])


@dataclass
class User:
    hub: Hub
    name: str
    token: str

    def request(self, method: str, path: str, **kw: Any) -> requests.Response:
        """``path`` under the hub's public URL, with this user's token."""
        headers = {"Authorization": f"token {self.token}", **kw.pop("headers", {})}
        return requests.request(method, f"{self.hub.url}{path}", headers=headers,
                                timeout=kw.pop("timeout", 90), allow_redirects=False, **kw)

    def start_server(self, profile: str) -> requests.Response:
        return self.request("POST", f"/hub/api/users/{self.name}/server",
                            json={"profile": profile})

    def model(self) -> dict:
        r = self.request("GET", f"/hub/api/users/{self.name}")
        r.raise_for_status()
        return r.json()

    def wait_ready(self, timeout_s: float = 300.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            server = self.model()["servers"].get("", {})
            if server.get("ready"):
                return server
            assert time.monotonic() < deadline, f"{self.name}'s server not ready: {server}\n" \
                + self.hub.tail()
            time.sleep(0.5)

    def wait_stopped(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.model()["servers"]:
            assert time.monotonic() < deadline, f"{self.name}'s server still runs"
            time.sleep(0.5)


class Kernel:
    """A kernel of ``user``'s server, driven over the Jupyter REST + websocket API through the
    hub's proxy (the protocol JupyterLab speaks)."""

    def __init__(self, user: User, kernel_id: str | None = None) -> None:
        """A new kernel, or a connection to the running ``kernel_id``."""
        self.user = user
        self.base = f"/user/{user.name}"
        if kernel_id is None:
            r = user.request("POST", f"{self.base}/api/kernels", json={"name": "python3"})
            assert r.status_code == 201, (r.status_code, r.text[:500])
            kernel_id = r.json()["id"]
        self.id = kernel_id
        ws_url = self.user.hub.url.replace("http", "ws", 1)
        self.ws = websocket.create_connection(
            f"{ws_url}{self.base}/api/kernels/{self.id}/channels",
            header=[f"Authorization: token {user.token}"], timeout=300)
        self.session = uuid.uuid4().hex

    def execute(self, code: str, timeout_s: float = 300.0) -> tuple[str, list[dict]]:
        """Run ``code``; (the text of its outputs, its error outputs)."""
        msg_id = uuid.uuid4().hex
        self.ws.send(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "test",
                       "session": self.session, "version": "5.3", "date": ""},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": True,
                        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True},
        }))
        texts: list[str] = []
        errors: list[dict] = []
        replied = idle = False
        deadline = time.monotonic() + timeout_s
        while not (replied and idle):
            assert time.monotonic() < deadline, f"no reply in {timeout_s} s to {code[:80]!r}"
            msg = json.loads(self.ws.recv())
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                texts.append(content["text"])
            elif kind in ("display_data", "update_display_data", "execute_result"):
                data = content.get("data", {})
                texts.append(data.get("text/plain", "") + data.get("text/html", ""))
            elif kind == "error":
                errors.append(content)
            elif kind == "execute_reply":
                replied = True
                if content["status"] == "error" and not errors:
                    errors.append(content)
            elif kind == "status" and content["execution_state"] == "idle":
                idle = True
        return "".join(texts), errors

    def close(self) -> None:
        """Close the websocket; the kernel (and a pool it started) keeps running."""
        self.ws.close()

    def shutdown(self) -> None:
        self.close()
        r = self.user.request("DELETE", f"{self.base}/api/kernels/{self.id}")
        assert r.status_code == 204, (r.status_code, r.text[:500])

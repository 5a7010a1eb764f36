"""A real Jupyter kernel driven like a notebook front end, for fault tests.

Interrupts and crashes must be tested the way a user meets them: the kernel's interrupt is a
SIGINT to the kernel process (the stop button), and output arrives as iopub messages.
"""

from __future__ import annotations

import contextlib
import os
import queue
import time
from dataclasses import dataclass, field
from typing import Any

from jupyter_client.manager import KernelManager


@dataclass
class Reply:
    status: str
    ename: str = ""
    evalue: str = ""
    traceback: list[str] = field(default_factory=list)
    text: str = ""  # stream + text/plain outputs, concatenated
    seconds: float = 0.0  # from collect() to the reply
    received_at: float = 0.0  # time.monotonic() when the reply arrived


class _PrefixedKernelManager(KernelManager):
    """Starts the kernel under an argv prefix (e.g. another host's namespace)."""

    prefix: list[str] = []

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        return [*self.prefix, *super().format_kernel_cmd(extra_arguments)]


class KernelSession:
    """``prefix``: run the kernel through this argv prefix (another test host); it then talks
    over unix sockets (``ipc`` transport) under ``socket_dir``, which both sides can reach."""

    def __init__(self, prefix: list[str] | None = None, socket_dir: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        env = dict(os.environ, IPP_NONINTERACTIVE="1", **(env or {}))
        if prefix:
            self.km = _PrefixedKernelManager(
                kernel_name="python3", transport="ipc", ip=os.path.join(socket_dir, "kernel"),
                connection_file=os.path.join(socket_dir, "kernel.json"))
            self.km.prefix = list(prefix)
        else:
            self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def submit(self, code: str) -> str:
        return self.kc.execute(code)

    def collect(self, msg_id: str, timeout_s: float = 120.0) -> Reply:
        """Gather output of ``msg_id`` until its reply and idle status arrive."""
        t0 = time.monotonic()
        text: list[str] = []
        reply: dict[str, Any] | None = None
        idle = False
        while reply is None or not idle:
            left = timeout_s - (time.monotonic() - t0)
            if left <= 0:
                raise TimeoutError(f"no reply within {timeout_s} s; output so far: {''.join(text)}")
            try:
                msg = self.kc.get_iopub_msg(timeout=min(left, 0.5))
                if msg["parent_header"].get("msg_id") == msg_id:
                    kind, content = msg["msg_type"], msg["content"]
                    if kind == "stream":
                        text.append(content["text"])
                    elif kind in ("execute_result", "display_data"):
                        text.append(content["data"].get("text/plain", "") + "\n")
                    elif kind == "error":
                        text.append("\n".join(content["traceback"]))
                    elif kind == "status" and content["execution_state"] == "idle":
                        idle = True
            except queue.Empty:
                pass
            if reply is None:
                try:
                    msg = self.kc.get_shell_msg(timeout=0.01)
                    if msg["parent_header"].get("msg_id") == msg_id:
                        reply = msg["content"]
                        received_at = time.monotonic()
                except queue.Empty:
                    pass
        return Reply(
            status=reply["status"], ename=reply.get("ename", ""), evalue=reply.get("evalue", ""),
            traceback=reply.get("traceback", []), text="".join(text), seconds=received_at - t0,
            received_at=received_at,
        )

    def run(self, code: str, timeout_s: float = 120.0) -> Reply:
        return self.collect(self.submit(code), timeout_s)

    def run_ok(self, code: str, timeout_s: float = 120.0) -> Reply:
        r = self.run(code, timeout_s)
        assert r.status == "ok", f"{r.ename}: {r.evalue}\n{r.text}"
        return r

    def wait_for_output(self, msg_id: str, text: str, timeout_s: float = 60.0) -> None:
        """Read ``msg_id``'s output until ``text`` appears (the messages read are dropped), so
        a test acts on what a cell did, not on a guess of how long it takes."""
        deadline = time.monotonic() + timeout_s
        seen: list[str] = []
        while text not in "".join(seen):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{text!r} not seen within {timeout_s} s: {''.join(seen)}")
            try:
                msg = self.kc.get_iopub_msg(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            content = msg["content"]
            if msg["msg_type"] == "stream":
                seen.append(content["text"])
            elif msg["msg_type"] in ("display_data", "execute_result"):
                seen.append(content["data"].get("text/plain", ""))

    def interrupt(self) -> None:
        self.km.interrupt_kernel()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.run("%colossal stop", timeout_s=60)
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)

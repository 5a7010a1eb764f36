"""Pool actions from the sidebar: run ``%colossal start|stop|restart`` in the owning kernel.

The pool is an object inside the kernel, so the only way to act on it is to execute code
there. The server does it itself through its kernel manager (not the browser), so an action
works for any kernel of this server, also one whose notebook has no pool yet, and the code run
is fixed here, never taken from the request.

Completion is read from the shell channel's ``execute_reply`` (no slow-joiner race, unlike
IOPub), then the action's output is collected from IOPub. ``stop_on_error=False`` matters:
a failing action must not abort cells the user has queued in the same kernel.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from queue import Empty
from typing import Any

ACTIONS = ("start", "stop", "restart")
MAX_RANKS = 256


@dataclass
class ActionResult:
    status: str  # "ok" | "error" | "pending"
    output: str = ""
    error: dict[str, str] = field(default_factory=dict)


def action_code(action: str, n: int | None = None) -> str:
    """The code an action runs: ``%colossal <action>``, loading the magics first if this
    kernel has not (``%load_ext`` itself would print a notice when they are loaded)."""
    if action not in ACTIONS:
        raise ValueError(f"unknown action {action!r}: use one of {', '.join(ACTIONS)}")
    args = action
    if action == "start" and n is not None:
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_RANKS:
            raise ValueError(f"n={n!r}: give the number of ranks as an integer 1..{MAX_RANKS}")
        args += f" -n {n}"
    return (
        "from IPython import get_ipython as _wb_ip\n"
        "try:\n"
        "    if 'ColossalMagics' not in _wb_ip().magics_manager.registry:\n"
        "        _wb_ip().run_line_magic('load_ext', 'workbench')\n"
        f"    _wb_ip().run_line_magic('colossal', {args!r})\n"
        "finally:\n"
        "    del _wb_ip\n"
    )


async def run_in_kernel(kernel: Any, code: str, wait_s: float) -> ActionResult:
    """Execute ``code`` in ``kernel`` (a jupyter_client kernel manager) and wait up to
    ``wait_s`` for it to finish; past that the action goes on in the kernel ("pending")."""
    client = kernel.client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=min(wait_s, 30.0))
        msg_id = client.execute(code, silent=False, store_history=False, allow_stdin=False,
                                stop_on_error=False)
        deadline = time.monotonic() + wait_s
        reply = None
        while reply is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return ActionResult("pending", "the kernel is still busy; the action runs "
                                    "when its current work ends")
            try:
                msg = await client.get_shell_msg(timeout=remaining)
            except Empty:
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                reply = msg["content"]
        output, error = await _collect_output(client, msg_id)
    finally:
        client.stop_channels()
    if reply.get("status") != "ok":
        error = error or {"ename": reply.get("ename", "Error"),
                          "evalue": reply.get("evalue", "")}
        return ActionResult("error", output, error)
    return ActionResult("ok", output)


async def _collect_output(client: Any, msg_id: str,
                          grace_s: float = 2.0) -> tuple[str, dict[str, str]]:
    """Stream text and the error of the request, until its idle status (or ``grace_s``)."""
    text: list[str] = []
    error: dict[str, str] = {}
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            msg = await client.get_iopub_msg(timeout=max(0.05, deadline - time.monotonic()))
        except Empty:  # no more output
            break
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["header"]["msg_type"], msg["content"]
        if kind == "stream":
            text.append(content.get("text", ""))
        elif kind == "error":
            error = {"ename": content.get("ename", ""), "evalue": content.get("evalue", "")}
        elif kind == "status" and content.get("execution_state") == "idle":
            break
    return "".join(text), error

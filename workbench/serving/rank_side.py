"""The rank side of a serving endpoint: every rank runs ``serve_engine`` as one long task while
the endpoint is up; each replica's leader connects to the server's bridge (``bridge.py``) and
the loop itself is ``kernels_runtime.inference.service.serve``. Imported by the notebook too
(``describe_engine`` is sent from there), so torch is imported inside the functions only."""

from __future__ import annotations

import json
from typing import Any

from ipyparallel import interactive

from kernels_runtime.inference.commands import Command


@interactive
def describe_engine(name: str) -> dict[str, Any] | str:
    """This rank's data-parallel replica of the engine ``name`` and the names of its LoRA
    adapters (``{"replica", "adapters"}``), or what the name holds."""
    from kernels_runtime.inference import Engine

    value = globals().get(name)
    if not isinstance(value, Engine):
        return "not defined" if value is None else f"a {type(value).__name__}"
    if value.tokenizer is None:
        return "an Engine without a tokenizer (the API answers in text)"
    return {"replica": int(value.ctx.dp_rank), "adapters": list(value.adapters.names)}


def serve_engine(engine: Any, address: str, secret: str) -> str:
    """Serve ``engine`` until the server sends stop; returns how it ended."""
    from kernels_runtime.inference import Engine
    from kernels_runtime.inference.service import replica_leader, serve

    if not isinstance(engine, Engine):
        raise TypeError(f"%colossal serve serves a kernels_runtime.inference.Engine; this "
                        f"rank's variable holds a {type(engine).__name__}")
    if not replica_leader(engine.ctx):
        serve(engine, None, None)
        return "stopped"
    import zmq

    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 1000)
    socket.connect(address)
    socket.send(json.dumps({"hello": secret, "replica": engine.ctx.dp_rank}).encode())

    def receive(timeout_s: float) -> list[Command]:
        commands = []
        if socket.poll(int(timeout_s * 1000)):
            while socket.poll(0):
                commands.append(Command.from_json(json.loads(socket.recv())))
        return commands

    def send(deltas: list[dict[str, Any]]) -> None:
        socket.send(json.dumps({"deltas": deltas}).encode())

    try:
        serve(engine, receive, send)
    finally:
        socket.close()
    return "stopped"

"""The rank side of a serving endpoint: every rank runs ``serve_engine`` as one long task while
the endpoint is up; each replica's leader connects to the server's bridge (``bridge.py``) and
the loop itself is ``kernels_runtime.inference.service.serve``. Imported by the notebook too
(``describe_engine`` is sent from there), so torch is imported inside the functions only."""

from __future__ import annotations

import json
import time
from typing import Any

from ipyparallel import interactive

from kernels_runtime.inference.commands import Command

# A leader that hears nothing from the server (not even its heartbeat, ``bridge.HEARTBEAT_S``)
# for this long takes it for dead: the kernel holding it was killed, say.
HEARTBEAT_MISS_S = 15.0


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

    heard = [time.monotonic()]  # when the server last sent anything
    in_flight: set[str] = set()  # requests this replica has not finished

    def receive(timeout_s: float) -> list[Command]:
        commands = []
        if socket.poll(int(timeout_s * 1000)):
            heard[0] = time.monotonic()
            while socket.poll(0):
                message = json.loads(socket.recv())
                if message.get("heartbeat"):
                    continue
                command = Command.from_json(message)
                if command.kind not in ("abort", "stop"):
                    in_flight.add(command.request_id)
                commands.append(command)
        elif time.monotonic() - heard[0] > HEARTBEAT_MISS_S:
            # the server is gone: end its requests and stop the replica (every rank of it
            # gets these commands in the same turn, so they leave the loop together)
            heard[0] = float("inf")  # once
            return [*(Command("abort", rid) for rid in sorted(in_flight)), Command("stop")]
        return commands

    def send(deltas: list[dict[str, Any]]) -> None:
        in_flight.difference_update(d["id"] for d in deltas if d.get("finish_reason"))
        socket.send(json.dumps({"deltas": deltas}).encode())

    try:
        serve(engine, receive, send)
    finally:
        socket.close()
    return "stopped"

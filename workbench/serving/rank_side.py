"""The rank side of a serving endpoint: every rank runs ``serve_engine`` as one long task while
the endpoint is up; each replica's leader connects to the server's bridge (``bridge.py``) and
the loop itself is ``kernels_runtime.inference.service.serve``. Imported by the notebook too
(``describe_engine`` is sent from there), so torch is imported inside the functions only."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from ipyparallel import interactive

from kernels_runtime.inference.commands import Command

log = logging.getLogger("workbench.serving.rank_side")

# A leader that hears nothing from the server (not even its heartbeat, ``bridge.HEARTBEAT_S``)
# for this long takes it for dead: the kernel holding it was killed, say.
HEARTBEAT_MISS_S = 15.0


@interactive
def describe_engine(name: str) -> dict[str, Any] | str:
    """This rank's data-parallel replica of the engine ``name``, the names of its LoRA
    adapters and its device type (``{"replica", "adapters", "device"}``), or what the name
    holds."""
    from kernels_runtime.inference import Engine

    value = globals().get(name)
    if not isinstance(value, Engine):
        return "not defined" if value is None else f"a {type(value).__name__}"
    if value.tokenizer is None:
        return "an Engine without a tokenizer (the API answers in text)"
    return {"replica": int(value.ctx.dp_rank), "adapters": list(value.adapters.names),
            "device": value.ctx.device.type}


def serve_engine(engine: Any, address: str, secret: str, server_key: str | None = None,
                 profile: bool = False, stream_interval_s: float = 0.0) -> str:
    """Serve ``engine`` until the server sends stop; returns how it ended. ``server_key`` is
    the bridge's CURVE public key where its traffic is encrypted (beyond loopback), else None.
    A replica whose engine fails (``ReplicaFailed``) tells the bridge before the error ends
    this rank's task, so the server takes it out of the rotation at once. ``profile``: deltas
    carry timestamps (``workbench/serving/profile.py``). ``stream_interval_s``: how often at most
    a request's tokens are sent (``kernels_runtime/inference/stream_pacing.py``)."""
    from kernels_runtime.inference import Engine
    from kernels_runtime.inference.service import ReplicaFailed, replica_leader, serve
    from workbench.serving.bridge import MAX_MESSAGE, leader_identity

    if not isinstance(engine, Engine):
        raise TypeError(f"%colossal serve serves a kernels_runtime.inference.Engine; this "
                        f"rank's variable holds a {type(engine).__name__}")
    if not replica_leader(engine.ctx):
        serve(engine, None, None, profile=profile)
        return "stopped"
    import zmq

    replica = int(engine.ctx.dp_rank)
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 1000)
    socket.setsockopt(zmq.ROUTING_ID, leader_identity(replica))
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
    if server_key is not None:  # encrypted: this leader's own key pair, the server's public key
        public, private = zmq.curve_keypair()
        socket.curve_publickey, socket.curve_secretkey = public, private
        socket.curve_serverkey = server_key.encode("ascii")
    socket.connect(address)
    socket.send(json.dumps({"hello": secret, "replica": replica}).encode())

    heard = [time.monotonic()]  # when the server last sent anything
    in_flight: set[str] = set()  # requests this replica has not finished

    def receive(timeout_s: float) -> list[Command]:
        commands = []
        if socket.poll(int(timeout_s * 1000)):
            heard[0] = time.monotonic()
            while socket.poll(0):
                command = _command(socket.recv())
                if command is None:
                    continue
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
        if profile:  # the step's deltas share one stamp list (service.py): stamp it once
            sent_ns = time.monotonic_ns()
            for stamps in {id(d["t"]): d["t"] for d in deltas if "t" in d}.values():
                stamps.append(sent_ns)
        socket.send(json.dumps({"deltas": deltas}).encode())

    try:
        serve(engine, receive, send, profile=profile, stream_interval_s=stream_interval_s)
    except ReplicaFailed as err:
        socket.send(json.dumps({"failed": str(err)}).encode())
        raise
    finally:
        socket.close()
    return "stopped"


def _command(payload: bytes) -> Command | None:
    """What the server sent, or None for a heartbeat or a message that is no command (logged:
    only the bridge can send here, so it is a bug, not an attack, and the loop goes on)."""
    try:
        message = json.loads(payload)
        if message.get("heartbeat"):
            return None
        command = Command.from_json(message)
        if command.kind not in ("completion", "chat", "abort", "stop"):
            raise ValueError(f"unknown command kind {command.kind!r}")
        return command
    except Exception as err:  # noqa: BLE001 - one bad message never ends the loop
        log.warning("a serving leader dropped a message from the server: %s: %s",
                    type(err).__name__, err)
        return None

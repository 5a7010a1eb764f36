"""The link between the HTTP server and the ranks: a ZeroMQ ROUTER socket in the server that
each replica's leader rank connects to (``rank_side.py``).

Requests go to the replica with the fewest requests in flight; what a leader sends back (each
changed request's new tokens and text, ``kernels_runtime.inference.service``) is handed to that
request's queue on the server's event loop. One thread owns the socket (ZeroMQ sockets are not
thread-safe): it sends what the event loop queued and receives what the leaders sent, waking
every few milliseconds. A leader's first message must carry the session's secret, so another
process on the host cannot pose as a rank; messages are JSON, never pickle.

Every ``HEARTBEAT_S`` the thread also sends each leader a heartbeat: a leader that hears nothing
for longer than its miss limit (``rank_side.HEARTBEAT_MISS_S``) knows the server (or the kernel
holding it) is gone, aborts its requests and stops its replica, instead of polling a dead
socket forever.
"""

from __future__ import annotations

import asyncio
import json
import queue
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from kernels_runtime.inference.commands import Command

POLL_MS = 2
HEARTBEAT_S = 1.0
HEARTBEAT = {"heartbeat": True}


class Bridge:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.secret = secrets.token_hex(16)
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.replicas: dict[bytes, int] = {}  # leader identity -> requests in flight
        self.owner: dict[str, bytes] = {}  # request id -> its replica's leader
        self.queues: dict[str, asyncio.Queue] = {}  # request id -> its deltas
        self.loop: asyncio.AbstractEventLoop | None = None
        self.outgoing: queue.Queue[tuple[bytes, dict[str, Any]]] = queue.Queue()
        self.on_delta: Callable[[dict[str, Any]], None] | None = None  # metrics
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="workbench-serving-bridge",
                                        daemon=True)
        self._thread.start()

    # ---- called from the event loop -------------------------------------------------------
    @property
    def connected(self) -> int:
        return len(self.replicas)

    def submit(self, command: Command) -> asyncio.Queue:
        """Send a request to the least busy replica; the queue its deltas arrive on."""
        with self.lock:
            if not self.replicas:
                raise RuntimeError("no replica is connected")
            leader = min(self.replicas, key=lambda k: self.replicas[k])
            self.replicas[leader] += 1
            self.owner[command.request_id] = leader
        q: asyncio.Queue = asyncio.Queue()
        self.queues[command.request_id] = q
        self.outgoing.put((leader, command.to_json()))
        return q

    def abort(self, request_id: str) -> None:
        leader = self.owner.get(request_id)
        if leader is not None:
            self.outgoing.put((leader, Command("abort", request_id).to_json()))

    def stop_replicas(self) -> None:
        for leader in list(self.replicas):
            self.outgoing.put((leader, Command("stop").to_json()))

    def fail_all(self, message: str) -> None:
        """End every request in flight with ``message`` (a rank died)."""
        for rid in list(self.queues):
            self._deliver({"id": rid, "token_ids": [], "text": "", "finish_reason": "error",
                           "error": message, "prompt_tokens": 0, "completion_tokens": 0})
        with self.lock:
            self.replicas.clear()

    def forget_replicas(self) -> None:
        with self.lock:
            self.replicas.clear()

    # ---- the socket thread ----------------------------------------------------------------
    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + HEARTBEAT_S
                with self.lock:
                    leaders = list(self.replicas)
                for leader in leaders:
                    self.outgoing.put((leader, HEARTBEAT))
            try:
                while True:
                    leader, message = self.outgoing.get_nowait()
                    self.socket.send_multipart([leader, json.dumps(message).encode()])
            except queue.Empty:
                pass
            if not self.socket.poll(POLL_MS):
                continue
            while self.socket.poll(0):
                leader, payload = self.socket.recv_multipart()
                self._received(leader, json.loads(payload))

    def _received(self, leader: bytes, message: dict[str, Any]) -> None:
        if message.get("hello") is not None:
            if secrets.compare_digest(str(message["hello"]), self.secret):
                with self.lock:
                    self.replicas.setdefault(leader, 0)
            return
        if leader not in self.replicas:
            return  # not a rank of this session
        for delta in message.get("deltas", []):
            self._deliver(delta)

    def _deliver(self, delta: dict[str, Any]) -> None:
        rid = delta["id"]
        if delta.get("finish_reason") is not None:
            with self.lock:
                leader = self.owner.pop(rid, None)
                if leader in self.replicas:
                    self.replicas[leader] -= 1
        if self.on_delta is not None:
            self.on_delta(delta)
        q = self.queues.get(rid)
        if q is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(q.put_nowait, delta)
        if delta.get("finish_reason") is not None:
            self.queues.pop(rid, None)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.socket.close(0)
